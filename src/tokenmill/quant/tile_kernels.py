"""The native tile kernels (csrc/gemv_kernels.cpp): linear layers over a copy of the weight in tiles of
16 output rows side by side, for float32, int8 and int4 weights.

int8 / int4: integer dot products with AVX-512 VNNI over activations quantized to int8 per group of 32 on
the fly (llama.cpp's Q8_0 recipe). They run every decode and verify row, whatever the step's number of
rows: measured 3-4x faster than PyTorch's weight-only kernels (which convert activations to bfloat16) from 1
to 512 rows, at 430-600 GOP/s against 200-230 GFLOP/s for the float32 GEMM (benchmarks/profile_step.py
shapes). So a generated token's logits do not depend on what shares its step. PyTorch's kernels (`apply`)
remain for CPUs without AVX-512 VNNI and for float32-compute reference modes.

Prefill rows of a step with many of them (layers/linear.py PrefillRows) run int8 / int4 through one bfloat16
GEMM instead where the CPU has AMX tiles (bind_bf16): oneDNN's AMX GEMM outruns the VNNI tiles from about 110
rows (3.1x at 2048) even with the weight widened on every call. A prompt's keys and values then depend on
whether its chunk's step had that many prefill rows (both ways within about 0.5% of the float32 product).

float32: a tiled GEMM with one FMA per 16 weights; faster than oneDNN where a step reads each weight
for few rows (decode: 1.5-3x at batch 1, 5-10% on the attention projections at 32-64 rows), equal at
prefill sizes, so it runs steps of up to FLOAT32_MAX_ROWS rows and oneDNN the larger ones. Same float32
arithmetic on both (only the summation order differs).
"""
from __future__ import annotations

import functools
import sys

import torch

from tokenmill.platforms import cpu_native

FLOAT32_MAX_ROWS = 128         # float32 steps above this run oneDNN (prefill chunks)
ANY_ROWS = sys.maxsize


def kernels():
    """The native module if it has the tile kernels (AVX-512 VNNI builds), else None."""
    native = cpu_native.load()
    return native if native is not None and hasattr(native, "gemv_q4") else None


@functools.cache
def bf16_gemm_faster() -> bool:
    """Whether large int4 / int8 steps run faster as a bfloat16 GEMM (csrc/tile_widen.cpp): the build has the
    widening kernels and the CPU has AMX tiles, which oneDNN's bfloat16 GEMM runs on (measured there only;
    without AMX the VNNI tile kernels stay)."""
    native = kernels()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)          # private; absent from older torch
    return native is not None and hasattr(native, "linear_tiles_bf16") and amx is not None and bool(amx())


def bind_bf16(layer, kind: str, tiles: torch.Tensor, scales: torch.Tensor | None):
    """x [P, in] -> csrc/tile_widen.cpp's linear_tiles_bf16 over the layer's `kind` ("q4" / "q8") tiles, plus
    the layer's bias (if any)."""
    fn, n, bias = kernels().linear_tiles_bf16, layer.out_features, layer.bias
    if bias is None:
        return lambda x: fn(x, kind, tiles, scales, n)
    return lambda x: fn(x, kind, tiles, scales, n).add_(bias)


def bind(layer, kernel: str, *weights: torch.Tensor):
    """x [T, in] -> native `kernel`(x, *weights, out_features) [T, out] plus the layer's bias (if any)."""
    fn, n, bias = getattr(kernels(), kernel), layer.out_features, layer.bias
    if bias is None:
        return lambda x: fn(x, *weights, n)
    return lambda x: fn(x, *weights, n).add_(bias)
