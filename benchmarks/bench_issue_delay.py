"""Issue delay of the bench generator: actual send time - scheduled time, at a target QPS (default 200)
against a minimal local OpenAI-compatible endpoint running in a separate process.

Prints p50 / p99 / max issue delay per run and the median over runs; the goal is p99 <= 5 ms at 200 QPS.
Usage: python benchmarks/bench_issue_delay.py [--qps 200] [--duration-s 5] [--runs 3]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from tokenmill.bench.metrics import percentile
from tokenmill.bench.records import Sample
from tokenmill.bench.runner import run_scenario_async, with_sut
from tokenmill.bench.scenarios import ServerScenario
from tokenmill.bench.sut.http import HttpConfig, HttpSUT

SERVER = """
import sys, time
from tokenmill.bench.fake_openai import FakeOpenAIServer, FakeServerConfig
srv = FakeOpenAIServer(FakeServerConfig(ttft_s=0.005, token_delay_s=0.002)).start()
print(srv.url, flush=True)
sys.stdin.read()
"""


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


async def one_run(url: str, qps: float, duration_s: float, seed: int, output_tokens: int):
    samples = [Sample(i, tuple(range(100, 132)), 32, output_tokens, output_tokens, True) for i in range(64)]
    sut = HttpSUT(HttpConfig(url, model="fake-model"))
    res = await with_sut(sut, lambda s: run_scenario_async(s, samples, ServerScenario(qps, duration_s, 1, seed=seed)))
    delays = [r.issue_delay_s * 1000 for r in res.records if r.issue_delay_s is not None]
    return res.metrics.num_issued, res.metrics.num_failed, delays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qps", type=float, default=200.0)
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=16)
    args = ap.parse_args()
    proc, url = start_server()
    try:
        p99s = []
        for i in range(args.runs):
            t = time.perf_counter()
            n, failed, d = asyncio.run(one_run(url, args.qps, args.duration_s, i, args.output_tokens))
            p99s.append(percentile(d, 0.99))
            print(f"run {i}: {n} requests ({failed} failed) in {time.perf_counter() - t:.1f} s; issue delay ms "
                  f"p50 {percentile(d, 0.5):.3f}  p99 {percentile(d, 0.99):.3f}  max {max(d):.3f}")
        verdict = "OK" if statistics.median(p99s) <= 5.0 else "ABOVE the 5 ms goal"
        print(f"median p99 issue delay at {args.qps:g} QPS: {statistics.median(p99s):.3f} ms ({verdict})")
    finally:
        proc.stdin.close()
        proc.wait(10)


if __name__ == "__main__":
    main()
