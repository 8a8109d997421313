"""Single-stream decode speed of the default model per weight format, against the memory-bandwidth bound.

One request at a time: 128 random prompt tokens -> exactly 256 output tokens (greedy, ignore EOS), for
fp32 / int8 / int4 / w8a8 (`LLM(quantization=...)`). Decode tok/s = (output tokens - 1) / (time of the
last token - time of the first), so prefill is excluded; median of --runs. For each mode it also prints
the bytes a decode step must read (every linear weight as packed, plus the mean KV cache read) and the
bound those bytes give at the read bandwidth measured right before that mode's runs (the best of a sum
and a matrix-vector product over 512 MiB, same threads), and the fraction of that bound achieved; where
the greedy head reads an int8 copy of a float32 lm_head instead, also the bound of the bytes read.
--profile MODE prints where one run's time goes.

With --llama-cpp PYTHON (the interpreter benchmarks/peers/llama_cpp_setup.sh prints), llama.cpp decodes
the same prompt from the same GGUF file in the same run (benchmarks/peers/llama_cpp_decode.py) and each
mode's speed is also given as a ratio to it.

    .venv/bin/python benchmarks/decode_latency.py [--runs 3] [--modes fp32,int8,int4,w8a8] [--profile int4]
        (a mode's suffix `+kvfp8`, e.g. `int4+kvfp8`, gives it an FP8 KV cache; `-exact`, e.g. `fp8-exact`,
        runs a format with a fast mode in its exact float32-activation mode)
        [--llama-cpp "$(benchmarks/peers/llama_cpp_setup.sh)"]
        [--checkpoints fp8-g32=DIR,...]     # pre-quantized checkpoints of the default model, as modes NAME
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import time

import torch


def measure_read_bandwidth_gbs(num_bytes: int = 1 << 29, runs: int = 7) -> float:
    """Read bandwidth in GB/s over a tensor far larger than the caches, the best of two read-only passes
    (each the median of `runs`): a sum, and the row-split matrix-vector product the float32 batch-1 path
    uses (it reads faster than the sum on some machines; the bound must not be beatable)."""
    from tokenmill.quant.unquantized import gemv_split_rows
    a = torch.ones(num_bytes // 4)
    w, x = a.view(-1, 512), torch.ones(1, 512)

    def rate(fn) -> float:
        fn()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return num_bytes / statistics.median(times) / 1e9

    return max(rate(a.sum), rate(lambda: gemv_split_rows(w, x)))


def linear_bytes(model) -> int:
    """Bytes of the linear weights one decode step at batch 1 reads, as the path that runs it stores them:
    the tile kernel's tiles where a layer has them, else the method's packed weight."""
    from tokenmill.layers.linear import Linear
    names = [("q4_tiles",), ("q8_tiles", "q8_tile_scales"), ("f32_tiles",), ("fp4_tiles", "fp4_tile_scale"), ("weight",),
             ("w8a8_weight_t", "w8a8_weight_scale"),
             ("int4_packed", "scales_and_zeros"), ("qweight", "scales"), ("fp8_weight", "fp8_scale"),
             ("fp4_weight", "fp4_scale", "fp4_row_scale")]
    total = 0
    for m in model.modules():
        if not isinstance(m, Linear):
            continue
        read = next(group for group in names if getattr(m, group[0], None) is not None)
        tensors = [t for t in (getattr(m, n) for n in read) if t is not None] + ([m.bias] if m.bias is not None else [])
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def head_saving(runner) -> int:
    """Bytes a greedy step reads less than linear_bytes counts: with the greedy head (layers/greedy_head.py)
    the float32 lm_head's tiles are not read; its int8 copy is, plus one 64-byte line of the float32 tiles
    per 16 rows and split-off input (greedy_head_outliers() of them), plus the rechecked rows (a few, not
    counted)."""
    head = getattr(runner, "greedy_head", None)
    if head is None:
        return 0
    blocks = head.f32_tiles.shape[0]
    outliers = head.native.greedy_head_outliers()
    return head.screen.tiles.numel() + outliers * blocks * 64 - head.f32_tiles.numel() * 4


def make_prompt(prompt_len: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(prompt_len)]


def decode_tok_s(llm, prompt: list[int], output_len: int) -> float:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs[0]
    times = out.metrics.token_times
    return (len(times) - 1) / (times[-1] - times[0])


def profile_run(llm, prompt: list[int], output_len: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        wall = time.perf_counter() - t0
    print(f"profile: {wall * 1e3 / output_len:.2f} ms per output token (wall, prefill included)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=44))


def llama_cpp_rates(python: str, runs: int, prompt_len: int, output_len: int) -> list[float]:
    """Decode tok/s of llama.cpp per run on the default model's GGUF, in its own interpreter."""
    import subprocess
    from tokenmill.loaders.default_model import default_model_path
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "llama_cpp_decode.py")
    out = subprocess.run([python, script, default_model_path(), "--runs", str(runs), "--prompt-len",
                          str(prompt_len), "--output-len", str(output_len), "--threads",
                          str(torch.get_num_threads())], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="fp32,int8,int4,w8a8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    ap.add_argument("--tied-head", choices=["method", "fp32"], default="method",
                    help="tied lm_head: as the method decides (quantized copy) or kept float32")
    ap.add_argument("--profile", default=None, help="mode to profile after timing")
    ap.add_argument("--llama-cpp", default=None, metavar="PYTHON",
                    help="interpreter with llama-cpp-python: measure llama.cpp in the same run")
    ap.add_argument("--checkpoints", default="",
                    help="NAME=DIR,...: pre-quantized checkpoints of the default model (e.g. written by "
                         "`tokenmill quantize`), measured as modes NAME after --modes")
    args = ap.parse_args()
    from quant_quality import parse_checkpoints
    checkpoints = parse_checkpoints(ap, args.checkpoints)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill import LLM
    from tokenmill.quant import base as quant_base
    from tokenmill.quant import exact_mode

    if args.tied_head == "fp32":
        quant_base.QuantMethod.quantize_tied_lm_head = False
    prompt = make_prompt(args.prompt_len)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); "
          f"batch 1, {args.prompt_len} prompt -> {args.output_len} output tokens; read bandwidth measured "
          "before each mode")
    peer = None
    if args.llama_cpp:
        rates = llama_cpp_rates(args.llama_cpp, args.runs, args.prompt_len, args.output_len)
        peer = statistics.median(rates)
        print(f"llama.cpp (same GGUF, Q4_1, {torch.get_num_threads()} threads): {peer:.1f} decode tok/s "
              f"(runs: {' '.join(f'{r:.1f}' for r in rates)})")
    print(f"{'mode':10s} {'decode tok/s':>12s} {'runs':>24s} {'GB/s':>6s} {'MB/step':>8s} {'bound tok/s':>11s} "
          f"{'of bound':>8s}" + (f" {'/llama.cpp':>10s}" if peer else ""))
    for mode in [m for m in args.modes.split(",") if m] + list(checkpoints):
        weights, _, kv = mode.partition("+kv")                            # e.g. int4+kvfp8: an FP8 KV cache
        fmt = weights.removesuffix("-exact")                              # e.g. fp8-exact: its exact mode
        if mode in checkpoints:
            llm = LLM(checkpoints[mode], kv_cache_memory_bytes=1 << 27)
        else:
            with exact_mode(fmt) if weights.endswith("-exact") else contextlib.nullcontext():
                llm = LLM(quantization=None if fmt == "fp32" else fmt, kv_cache_dtype=kv or "auto",
                          kv_cache_memory_bytes=1 << 27)
        cfg = llm.engine.config.model
        kv_mean = cfg.kv_bytes_per_token * (args.prompt_len + args.output_len / 2)
        runner = llm.engine.core.runner
        step_bytes = linear_bytes(runner.model) + kv_mean
        read_bytes = step_bytes + head_saving(runner)
        decode_tok_s(llm, prompt, 16)                                   # warm-up
        bandwidth = measure_read_bandwidth_gbs()
        rates = [decode_tok_s(llm, prompt, args.output_len) for _ in range(args.runs)]
        med, bound = statistics.median(rates), bandwidth * 1e9 / step_bytes
        read_bound = bandwidth * 1e9 / read_bytes
        print(f"{mode:10s} {med:12.1f} {' '.join(f'{r:.1f}' for r in rates):>24s} {bandwidth:6.1f} "
              f"{step_bytes / 1e6:8.1f} {bound:11.1f} {med / bound:8.0%}" + (f" {med / peer:9.2f}x" if peer else ""),
              flush=True)
        if read_bytes != step_bytes:
            print(f"{'':10s} the greedy head reads its int8 copy instead: {read_bytes / 1e6:.1f} MB/step, "
                  f"bound {read_bound:.1f} tok/s, {med / read_bound:.0%} of it")
        if mode == args.profile:
            profile_run(llm, prompt, args.output_len)
        del llm


if __name__ == "__main__":
    main()
