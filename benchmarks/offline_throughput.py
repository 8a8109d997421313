"""Offline throughput on the peer workload of shared/BENCHMARKING.md, tokenmill vs transformers.

64 requests x 128 random prompt tokens -> exactly 128 output tokens each (ignore EOS), greedy, all
issued at once, default model (SmolLM2-135M-Instruct, weights dequantized to fp32). In the same run:
transformers' static-batch `generate` on the same weights. Prints wall time and output tokens/s of
each (median of --runs), their ratio, whether the first run's greedy tokens are identical to
transformers' (fp32 weights), and tokenmill's start-up time to the first generated token of
`tokenmill generate` (first and second start).

    .venv/bin/python benchmarks/offline_throughput.py [--runs 3] [--num-requests 64] [--skip-peer]

Comparisons instead (no peer, no start-up): --quantization int4,nvfp4,mxfp4 and / or --kv-cache-dtypes
auto,fp8 build one engine per combination and interleave their runs; each rate is given as a ratio to the
first's. --checkpoints NAME=DIR,... adds pre-quantized checkpoints of the default model (e.g. written by
`tokenmill quantize`) to those engines, after them.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch


def make_prompts(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(n)]


def run_tokenmill(llm, prompts, output_len: int) -> tuple[float, list[list[int]]]:
    """-> (wall seconds, each request's output token ids, in prompt order)."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, [list(o.outputs[0].token_ids) for o in outs]


def load_transformers_model():
    from transformers import AutoModelForCausalLM
    from tokenmill.loaders.default_model import DEFAULT_MODEL_FILE, default_model_path
    folder = os.path.dirname(default_model_path())
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32).eval()


def run_transformers(model, prompts, output_len: int) -> tuple[float, list[list[int]]]:
    """-> (wall seconds, each prompt's output token ids). Prompts of one length: no padding."""
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    return wall, out[:, ids.shape[1]:].tolist()


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """How many requests' greedy outputs are identical, and where the others first differ."""
    differing = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                 for x, y in zip(ours, theirs) if x != y]     # first output position that differs, per request
    line = f"greedy tokens identical to transformers' in {len(ours) - len(differing)} of {len(ours)} requests"
    return line + (f" (the others first differ at output positions {sorted(differing)})" if differing else "")


def startup_to_first_token() -> list[float]:
    """Seconds from launching `tokenmill generate` to the first byte of generated text on its stdout,
    for a first and a second start (the second reuses the tokenizer cache)."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "generate", "The capital of France is",
                                 "--max-tokens", "4", "--ignore-eos"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        proc.stdout.read(1)
        times.append(time.perf_counter() - t0)
        proc.communicate()
    return times


def median_rate(runs: list[tuple[float, list[list[int]]]]) -> tuple[float, float]:
    """-> (median wall seconds, output tokens per second at that wall)."""
    wall = statistics.median(w for w, _ in runs)
    return wall, sum(len(t) for t in runs[0][1]) / wall


def compare_engines(LLM, engine_kwargs: dict, variants: dict[str, dict], prompts, args) -> None:
    """One engine per variant (label -> extra engine arguments), runs interleaved; wall-clock medians and
    rates against the first variant's."""
    from tokenmill.quant import exact_mode
    engines = {}
    for label, extra in variants.items():                      # "fp8-exact": fp8 in its exact mode
        quant = extra.get("quantization") or ""
        with exact_mode(quant.removesuffix("-exact")) if quant.endswith("-exact") else contextlib.nullcontext():
            engines[label] = LLM(**engine_kwargs, **dict(extra, quantization=quant.removesuffix("-exact") or None))
    runs: dict[str, list] = {label: [] for label in variants}
    for llm in engines.values():
        run_tokenmill(llm, prompts[:2], 4)  # warm-up
    for i in range(args.runs):
        for label, llm in engines.items():
            runs[label].append(run_tokenmill(llm, prompts, args.output_len))
        print(f"run {i + 1}: " + ", ".join(f"{label} {runs[label][-1][0]:.2f} s" for label in variants), flush=True)
    print(f"workload: {args.num_requests} requests x {args.prompt_len} -> {args.output_len}, greedy, default model; "
          f"median of {args.runs} runs")
    first = next(iter(variants))
    base = median_rate(runs[first])[1]
    for label in variants:
        wall, rate = median_rate(runs[label])
        same = sum(a == b for a, b in zip(runs[label][0][1], runs[first][0][1]))
        print(f"{label:18s} wall {wall:7.2f} s  output {rate:7.1f} tok/s  {rate / base:.3f}x  greedy outputs "
              f"identical to {first}'s: {same} of {len(prompts)}  (runs: "
              + ", ".join(f"{w:.2f}" for w, _ in runs[label]) + ")")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quantization", default=None,
                    help="a weight format, or several comma-separated (int4,nvfp4: one engine each, runs "
                         "interleaved, each's rate as a ratio to the first; 'fp32' for none; fp8-exact, "
                         "nvfp4-exact, mxfp4-exact: the format's exact mode)")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="comma-separated KV cache dtypes (auto,fp8): one engine each, runs interleaved, "
                         "each's rate as a ratio to the first")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--checkpoints", default="",
                    help="NAME=DIR,...: pre-quantized checkpoints of the default model, compared after the "
                         "--quantization / --kv-cache-dtypes engines")
    args = ap.parse_args()
    from quant_quality import parse_checkpoints
    checkpoints = parse_checkpoints(ap, args.checkpoints)
    from tokenmill import LLM

    prompts = make_prompts(args.num_requests, args.prompt_len)
    engine_kwargs = dict(enable_prefix_caching=False, max_num_batched_tokens=args.max_num_batched_tokens)
    kv_dtypes = args.kv_cache_dtypes.split(",")
    quants = (args.quantization or "fp32").split(",")
    if len(kv_dtypes) > 1 or len(quants) > 1 or checkpoints:
        variants = {f"{q} / kv {d}": dict(quantization=None if q == "fp32" else q, kv_cache_dtype=d)
                    for q in quants for d in kv_dtypes}
        variants.update({name: dict(model=path, kv_cache_dtype=kv_dtypes[0]) for name, path in checkpoints.items()})
        compare_engines(LLM, engine_kwargs, variants, prompts, args)
        return
    if args.quantization and args.quantization != "fp32":
        engine_kwargs["quantization"] = args.quantization
    llm = LLM(**engine_kwargs, kv_cache_dtype=kv_dtypes[0])
    run_tokenmill(llm, prompts[:2], 4)  # warm-up
    model = None if args.skip_peer else load_transformers_model()
    if model is not None:
        run_transformers(model, prompts[:2], 4)
    tm_runs, hf_runs = [], []
    for i in range(args.runs):  # interleaved, so drift on the machine affects both alike
        tm_runs.append(run_tokenmill(llm, prompts, args.output_len))
        if model is not None:
            hf_runs.append(run_transformers(model, prompts, args.output_len))
        print(f"run {i + 1}: tokenmill {tm_runs[-1][0]:.2f} s"
              + (f", transformers {hf_runs[-1][0]:.2f} s" if hf_runs else ""), flush=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"workload: {args.num_requests} requests x {args.prompt_len} prompt tokens -> {args.output_len} "
          f"output tokens, greedy, default model, {args.quantization or 'fp32'} weights; "
          f"median of {args.runs} runs")
    tm_wall, tm_rate = median_rate(tm_runs)
    print(f"tokenmill     wall {tm_wall:7.2f} s  output {tm_rate:7.1f} tok/s  (runs: "
          + ", ".join(f"{w:.2f}" for w, _ in tm_runs) + ")")
    if hf_runs:
        hf_wall, hf_rate = median_rate(hf_runs)
        print(f"transformers  wall {hf_wall:7.2f} s  output {hf_rate:7.1f} tok/s  (runs: "
              + ", ".join(f"{w:.2f}" for w, _ in hf_runs) + ")")
        print(f"ratio tokenmill / transformers: {tm_rate / hf_rate:.2f}x")
        if not args.quantization:   # same fp32 weights: the tokens should be the same too (first run's)
            print(greedy_agreement(tm_runs[0][1], hf_runs[0][1]))
    if not args.skip_startup:
        first, second = startup_to_first_token()
        print(f"tokenmill generate start-up to first token: first start {first:.1f} s, second start {second:.1f} s")


if __name__ == "__main__":
    main()
