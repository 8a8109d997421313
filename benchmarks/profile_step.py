"""Where a step's time goes: torch.profiler over the offline workload's steps (default model, fp32),
grouped by op, for a prefill-heavy phase and a decode-only phase, and how many tokens per row the greedy
head rechecked exactly. Prints tables; asserts nothing.

    .venv/bin/python benchmarks/profile_step.py [--num-requests 64] [--prompt-len 128] [--decode-steps 16]
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens,
              quantization=args.quantization)
    rng = random.Random(0)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(args.num_requests):
        engine.add_request(str(i), [rng.randrange(100, 40000) for _ in range(args.prompt_len)], params)
    steps = []
    with profile(activities=[ProfilerActivity.CPU]) as prefill_prof:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.requests.values()):
            t0 = time.perf_counter()
            engine.step()
            steps.append(("prefill", time.perf_counter() - t0))
    with profile(activities=[ProfilerActivity.CPU]) as decode_prof:
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            engine.step()
            steps.append(("decode", time.perf_counter() - t0))
    for name, prof in (("prefill phase", prefill_prof), ("decode phase", decode_prof)):
        times = [t for kind, t in steps if name.startswith(kind)]
        print(f"\n== {name}: {len(times)} steps, median {1000 * sorted(times)[len(times) // 2]:.1f} ms/step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    head = engine.core.runner.greedy_head
    if head is not None and head.rows_screened:
        print(f"greedy head: {head.rows_screened} rows answered without float32 logits, "
              f"{head.candidates_checked / head.rows_screened:.2f} tokens rechecked exactly per row")


if __name__ == "__main__":
    main()
