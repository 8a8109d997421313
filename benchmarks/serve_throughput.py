"""HTTP serving overhead: the peer workload through `tokenmill serve` vs the in-process AsyncEngine.

Workload (BENCHMARKING.md peers): N requests x 128 random prompt tokens -> exactly 128 output tokens
(ignore_eos), greedy, default model, driven by 32 concurrent streaming clients. Both runs happen in this
one script on the same prompts; output tokens are counted from token ids (in-process) and from the
server's `usage` (HTTP), never from chunks. Prints output tokens/s of each and the ratio HTTP/in-process
(target >= 90%).

    python benchmarks/serve_throughput.py [--num-requests 64] [--concurrency 32] [--model PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the default model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="runs of each side (alternating); medians reported")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads in both engines")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Stay clear of the special tokens at the low end of the vocabulary.
    return [rng.integers(100, vocab, size=length).tolist() for _ in range(num)]


# -------------------------------------------------------------------------------------- in-process
def make_engine(args):
    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    return AsyncEngine(EngineArgs(model=args.model, num_threads=args.num_threads, seed=args.seed))


async def run_in_process(engine, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[int, float]:
    from tokenmill.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with gate:
            final = None
            async for out in engine.generate(prompts[i], params, f"bench-{time.monotonic_ns()}-{i}"):
                final = out
            return final.num_generated_tokens

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return sum(tokens), time.perf_counter() - t0


# -------------------------------------------------------------------------------------------- HTTP
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill.server", "--port", str(port), "--log-level", "warning",
           "--seed", str(args.seed), "--max-waiting-requests", str(max(512, args.num_requests))]
    if args.model:
        cmd += ["--model", args.model]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


async def run_http(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[int, float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> int:
        body = {"prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        usage = None
        async with gate, client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if '"usage":{' in line:   # parse only the final usage event: keep client CPU low
                    usage = json.loads(line[6:])["usage"]
        return usage["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=3600) as client:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, ids) for ids in prompts))
        return sum(tokens), time.perf_counter() - t0


# -------------------------------------------------------------------------------------------- main
def report(name: str, runs: list[tuple[int, float]]) -> float:
    rates = [tok / wall for tok, wall in runs]
    tok, wall = runs[-1]
    print(f"{name:<12} output tokens {tok:6d}  wall {statistics.median(w for _, w in runs):7.2f} s  "
          f"{statistics.median(rates):8.1f} tok/s  (runs: {', '.join(f'{r:.1f}' for r in rates)})")
    return statistics.median(rates)


def main() -> int:
    args = parse_args()
    engine = make_engine(args)
    prompts = random_prompts(args.num_requests, args.prompt_len, len(engine.tokenizer), args.seed)
    warm = prompts[:2]
    in_proc: list[tuple[int, float]] = []
    http: list[tuple[int, float]] = []
    port = free_port()
    for _ in range(args.repeats):
        if engine is None:
            engine = make_engine(args)
        asyncio.run(run_in_process(engine, warm, 4, 2))
        in_proc.append(asyncio.run(run_in_process(engine, prompts, args.output_len, args.concurrency)))
        engine.shutdown()
        engine = None
        server = start_server(args, port)
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(run_http(url, warm, 4, 2))
            http.append(asyncio.run(run_http(url, prompts, args.output_len, args.concurrency)))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    expected = args.num_requests * args.output_len
    print(f"workload: {args.num_requests} requests x {args.prompt_len} prompt tokens -> {args.output_len} output "
          f"tokens, {args.concurrency} concurrent streaming clients, greedy, ignore_eos; "
          f"model {args.model or 'default'}; {os.cpu_count()} CPUs")
    a = report("in-process", in_proc)
    b = report("HTTP", http)
    for name, runs in (("in-process", in_proc), ("HTTP", http)):
        if any(tok != expected for tok, _ in runs):
            print(f"WARNING: {name} produced {[t for t, _ in runs]} output tokens, expected {expected}")
    print(f"ratio HTTP / in-process: {b / a:.1%} (target >= 90%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
