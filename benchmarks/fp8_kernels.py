"""FP8's linear kernels on this CPU, per step size, on the default model's layer shapes: where each is fastest
(FP8Method's EXACT_MAX_ROWS / FAST_F16_MAX_ROWS / FAST_MAX_ROWS come from here), and how they compare with
int8's tile kernel.

    grouped   moe_grouped_gemm with one group: float32 activations, codes decoded in registers (exact)
    f32-gemm  fp8_dequantize to a temporary float32 [N, K] + one float32 GEMM (exact mode, large steps)
    bf16-gemm fp8_linear_bf16: codes widened to bfloat16 + one oneDNN bfloat16 GEMM (fast mode, large steps;
              AMX tiles where the CPU has them)
    bf16-gemv fp8_gemv_bf16: codes widened to bfloat16 in registers, x rounded to bfloat16, float32 sums
              (fast mode, steps of up to FAST_MAX_ROWS; AVX-512 BF16 + VBMI builds without FP16)
    f16-gemv  fp8_gemv_f16: codes widened to fp16 in registers, x scaled and rounded to fp16, short fp16 sums
              then float32 (fast mode, steps of up to FAST_F16_MAX_ROWS; AVX-512 FP16 builds)
    int8      gemv_q8 on int8 tiles of the same weight (int8 activations per 32): the reference speed

Times are medians of --repeats calls (after one warm-up), in ms per call; the ratio columns are int8's time
over each FP8 kernel's (1.0 = as fast as int8), measured in the same run.

    .venv/bin/python benchmarks/fp8_kernels.py [--rows 1,8,16,24,32,40,64,128,512] [--repeats 15]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# (out_features, in_features) of SmolLM2-135M's linears: qkv, o_proj, gate_up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    from tokenmill.platforms import cpu_native
    from tokenmill.quant.int8 import pack_q8_tiles, quantize_per_channel_int8
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,24,32,40,64,128,512")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    native = cpu_native.load()
    if native is None or not hasattr(native, "gemv_q8"):
        raise SystemExit("needs the native tile kernels (an AVX-512 VNNI CPU and a compiler)")
    fast = getattr(native, "fp8_linear_bf16", None)
    gemv = getattr(native, "fp8_gemv_bf16", None)
    f16 = getattr(native, "fp8_gemv_f16", None)
    torch.manual_seed(0)
    print(f"{'rows':>5} {'grouped':>8} {'f32-gemm':>9} {'bf16-gemm':>10} {'bf16-gemv':>10} {'f16-gemv':>9} {'int8':>7}"
          "   int8 time / fp8 kernel's (grouped, f32, bf16-gemm, bf16-gemv, f16-gemv)   [ms per step, summed over "
          "the 4 shapes]")
    for rows in [int(r) for r in args.rows.split(",")]:
        total = {"grouped": 0.0, "f32": 0.0, "bf16": 0.0, "gemv": 0.0, "f16": 0.0, "int8": 0.0}
        for n, k in SHAPES:
            w = torch.randn(n, k) * 0.05
            scale = (w.abs().amax(1, keepdim=True) / 448).contiguous()
            codes = (w / scale).to(torch.float8_e4m3fn).contiguous()
            tiles, q8_scales = pack_q8_tiles(*quantize_per_channel_int8(w))
            x = torch.randn(rows, k)
            run = torch.tensor([0, rows])
            total["grouped"] += median_ms(lambda: native.moe_grouped_gemm(x, run, codes[None], scale[None], k),
                                          args.repeats)
            total["f32"] += median_ms(lambda: torch.nn.functional.linear(x, native.fp8_dequantize(codes, scale, k)),
                                      args.repeats)
            if fast is not None:
                total["bf16"] += median_ms(lambda: fast(x, codes, scale, k), args.repeats)
            if gemv is not None:
                total["gemv"] += median_ms(lambda: gemv(x, codes, scale, k), args.repeats)
            if f16 is not None:
                total["f16"] += median_ms(lambda: f16(x, codes, scale, k), args.repeats)
            total["int8"] += median_ms(lambda: native.gemv_q8(x, tiles, q8_scales, n), args.repeats)
        bf16 = f"{total['bf16']:10.3f}" if fast is not None else f"{'n/a':>10}"
        bf16_gemv = f"{total['gemv']:10.3f}" if gemv is not None else f"{'n/a':>10}"
        f16_gemv = f"{total['f16']:9.3f}" if f16 is not None else f"{'n/a':>9}"
        ratios = ", ".join(f"{total['int8'] / total[key]:.2f}" if total[key] else "n/a"
                           for key in ("grouped", "f32", "bf16", "gemv", "f16"))
        print(f"{rows:5d} {total['grouped']:8.3f} {total['f32']:9.3f} {bf16} {bf16_gemv} {f16_gemv} "
              f"{total['int8']:7.3f}   {ratios}")


if __name__ == "__main__":
    main()
