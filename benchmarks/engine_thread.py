"""Decode speed of one engine stepped from the thread that built it vs from AsyncEngine's loop thread.

The served path (`tokenmill serve`, `tokenmill bench` in process, `make run`) steps the engine on
AsyncEngine's thread while the model was loaded and calibrated on the caller's. Three configurations of
the same engine, interleaved run by run (platforms/host_threads.py explains the difference):
- `builder`: LLMEngine stepped on the thread that built it (what `LLM.generate` does);
- `async, team kept`: AsyncEngine with the builder's OpenMP team left alive (tokenmill before the fix);
- `async`: AsyncEngine as shipped (the builder's team given back first).

Workload: B concurrent requests (--batches), random prompts of --prompt-len tokens, exactly --output-len
output tokens (greedy, ignore EOS), prefix caching off. Per configuration: output tok/s over the whole
run (prefill included) and the mean TPOT (time between a request's first and last token over its
tokens after the first, averaged over requests); medians of --runs.

    .venv/bin/python benchmarks/engine_thread.py [--quantization int4] [--batches 1,16] [--runs 3]
"""
from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine import async_engine as async_engine_module
from tokenmill.platforms.host_threads import release_thread_pool

CONFIGS = ("builder", "async, team kept", "async")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--batches", default="1,16", help="comma-separated numbers of concurrent requests")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def summarize(start: float, times: dict[str, list[float]]) -> tuple[float, float]:
    """(output tok/s over the run, mean TPOT in ms) from each request's token arrival times."""
    end = max(t[-1] for t in times.values())
    tokens = sum(len(t) for t in times.values())
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return tokens / (end - start), 1000 * statistics.mean(tpots)


def run_builder(llm: LLM, prompts, params) -> tuple[float, float]:
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"b{i}", p, params, stream=True)
        times[f"b{i}"] = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            now = time.perf_counter()
            times[out.request_id].extend([now] * len(out.outputs[0].new_token_ids))
    return summarize(start, times)


def run_async(llm: LLM, prompts, params, keep_team: bool, tag: str) -> tuple[float, float]:
    original = async_engine_module.release_thread_pool
    if keep_team:
        async_engine_module.release_thread_pool = lambda: 0
    try:
        engine = async_engine_module.AsyncEngine(engine=llm.engine)
    finally:
        async_engine_module.release_thread_pool = original
    times: dict[str, list[float]] = {}

    async def one(i: int, p) -> None:
        rid = f"{tag}{i}"
        times[rid] = []
        async for out in engine.generate(p, params, rid):
            now = time.perf_counter()
            times[rid].extend([now] * len(out.outputs[0].new_token_ids))

    async def all_of_them() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return start

    try:
        start = asyncio.run(all_of_them())
    finally:
        engine.shutdown()                        # the in-process executor has no workers: llm stays usable
    return summarize(start, times)


def main() -> None:
    args = parse_args()
    llm = LLM(args.model, quantization=args.quantization, enable_prefix_caching=False)
    rng = random.Random(args.seed)
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for run in range(args.runs):
        for batch in batches:
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
            for config in CONFIGS:
                if config == "builder":
                    figures = run_builder(llm, prompts, params)
                else:
                    figures = run_async(llm, prompts, params, keep_team=config != "async", tag=f"r{run}")
                results.setdefault((batch, config), []).append(figures)
                print(f"run {run + 1} batch {batch:3d} {config:18s} {figures[0]:8.1f} tok/s  "
                      f"TPOT {figures[1]:6.2f} ms", flush=True)
    release_thread_pool()
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"{args.quantization}, {args.prompt_len} -> {args.output_len} tokens, medians of {args.runs}")
    print("| batch | configuration | output tok/s | vs builder | mean TPOT ms |")
    print("|---|---|---|---|---|")
    for batch in batches:
        base = statistics.median(f[0] for f in results[(batch, "builder")])
        for config in CONFIGS:
            rate = statistics.median(f[0] for f in results[(batch, config)])
            tpot = statistics.median(f[1] for f in results[(batch, config)])
            print(f"| {batch} | {config} | {rate:.1f} | {rate / base:.3f} | {tpot:.2f} |")


if __name__ == "__main__":
    main()
