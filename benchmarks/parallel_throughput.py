"""Parallel configurations of the default model on this machine, measured in one run (issue 15):

    uni      one rank in the engine's process, all threads (today's path)
    mp-tp1   one rank in a worker process (the mp executor's cost: messages, pipes)
    tp2      two tensor-parallel ranks, threads split between them
    dp2      two data-parallel replicas (engine-core processes), threads split between them

For each, per --modes weight format: Offline (--num-requests x 128 random prompt tokens -> exactly 128
output tokens, greedy, all at once) wall time and output tok/s, and the decode step time at full batch
(the median over steps where every request decodes one token; not for dp2, whose replicas step on their
own); medians of --runs. Every configuration is built first; the runs then alternate between them (each
round in the reverse order of the one before), so that the VM's drifting speed falls on all alike. Ratios
are against `uni` measured in the same run; the mp executor's overhead is (mp-tp1 step - uni step) / uni step.

    .venv/bin/python benchmarks/parallel_throughput.py [--runs 3] [--modes fp32,int4] [--configs uni,mp-tp1,tp2]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

CONFIGS = {"uni": dict(), "mp-tp1": dict(distributed_executor_backend="mp"),
           "tp2": dict(tensor_parallel_size=2), "dp2": dict(data_parallel_size=2)}


def prompts(n: int, length: int = 128) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_once(llm, batch: list[list[int]]) -> tuple[float, int, list[float]]:
    """(wall s, output tokens, step times of full-batch decode steps)."""
    from tokenmill import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    tokens, decode_steps = 0, []
    scheduler = getattr(engine.core, "scheduler", None)          # replicas schedule in their processes
    while engine.has_unfinished_requests():
        full = scheduler is not None and len(scheduler.running) == len(batch) and not scheduler.waiting and \
            all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
        s0 = time.perf_counter()
        outs = engine.step()
        if full:
            decode_steps.append(time.perf_counter() - s0)
        tokens += sum(len(c.token_ids) for o in outs if o.finished for c in o.outputs)
    return time.perf_counter() - t0, tokens, decode_steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--modes", default="fp32,int4")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    from tokenmill import LLM
    batch = prompts(args.num_requests)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{args.num_requests} x 128 -> 128 tokens, medians of {args.runs}")
    for mode in args.modes.split(","):
        names = args.configs.split(",")
        llms = {name: LLM(quantization=None if mode == "fp32" else mode, enable_prefix_caching=False,
                          kv_cache_memory_bytes=1 << 30, **CONFIGS[name]) for name in names}
        for llm in llms.values():
            run_once(llm, batch[:4])                                       # warm-up
        walls, rates, steps = ({name: [] for name in names} for _ in range(3))
        for r in range(args.runs):                  # the configs alternate, in turn reversed: the VM's drift
            for name in (names if r % 2 == 0 else names[::-1]):          # lands on all of them alike
                wall, tokens, decode = run_once(llms[name], batch)
                walls[name].append(wall)
                rates[name].append(tokens / wall)
                steps[name].append(statistics.median(decode) if decode else float("nan"))
        for llm in llms.values():
            llm.shutdown()
        results = {name: (statistics.median(walls[name]), statistics.median(rates[name]),
                          statistics.median(steps[name])) for name in names}
        base = results.get("uni")
        for name, (wall, rate, step) in results.items():
            ratio = f"  x{rate / base[1]:.3f} of uni, step {step / base[2] - 1:+.1%}" if base and name != "uni" else ""
            print(f"{mode:5s} {name:7s} wall {wall:7.2f} s  {rate:7.1f} tok/s  decode step @{args.num_requests} "
                  f"{step * 1e3:7.2f} ms{ratio}")


if __name__ == "__main__":
    main()
