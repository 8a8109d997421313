"""The native tile kernels (csrc/gemv_kernels.cpp): linear layers over a copy of the weight in tiles of
16 output rows side by side, for float32, int8 and int4 weights.

int8 / int4: integer dot products with AVX-512 VNNI over activations quantized to int8 per group of 32 on
the fly (llama.cpp's Q8_0 recipe): measured 3-4x faster than PyTorch's weight-only kernels (which convert
activations to bfloat16) from 1 to 512 rows, at 430-600 GOP/s against 200-230 GFLOP/s for the float32 GEMM
(benchmarks/profile_step.py shapes). PyTorch's kernels (`apply`) remain for CPUs without AVX-512 VNNI and for
float32-compute reference modes.

Where the build and CPU have AMX-BF16, a step of 32 rows or more (the native amx_min_rows()) runs the same
gemv_q4 / gemv_q8 call on AMX instead (csrc/amx_tiles.cpp): the weights widened to bfloat16 on every call, the
activations rounded to bfloat16, float32 sums. Measured (benchmarks/amx_tiles.py), the default model's shapes
alternated with the VNNI kernels: a decoder layer's four linears 1.34x at 32 rows, 1.57x at 64, 1.70x at 128;
its int8 lm_head 1.04x / 1.18x / 1.24x; 0.5x at 8 rows, even at 16-24 (the widening is a fixed cost). Such a
step's logits differ from a smaller step's by the two paths' roundings (bfloat16 here, int8 activations there;
both within about 1% of the float32 product), so on those CPUs a token depends on whether its step had that
many rows. TOKENMILL_AMX_MIN_ROWS=N moves the threshold (0: the VNNI kernels at every size).

Prefill rows of a step with many of them (layers/linear.py PrefillRows) run int8 / int4 through one bfloat16
GEMM instead where the CPU has AMX tiles (bind_bf16): oneDNN's AMX GEMM outruns the VNNI tiles from about 110
rows (3.1x at 2048) even with the weight widened on every call, and the AMX tile kernels only from about 1,280
(QuantMethod.prefill_rows_from). A prompt's keys and values then depend on whether its chunk's step had that
many prefill rows (both ways within about 0.5% of the float32 product).

float32: a tiled GEMM with one FMA per 16 weights; faster than oneDNN where a step reads each weight
for few rows (decode: 1.5-3x at batch 1, 5-10% on the attention projections at 32-64 rows), equal at
prefill sizes, so it runs steps of up to FLOAT32_MAX_ROWS rows and oneDNN the larger ones. Same float32
arithmetic on both (only the summation order differs).
"""
from __future__ import annotations

import functools
import os
import sys

import torch

from tokenmill.platforms import cpu_native

FLOAT32_MAX_ROWS = 128         # float32 steps above this run oneDNN (prefill chunks)
ANY_ROWS = sys.maxsize


AMX_MIN_ROWS_ENV = "TOKENMILL_AMX_MIN_ROWS"


def kernels():
    """The native module if it has the tile kernels (AVX-512 VNNI builds), else None."""
    native = cpu_native.load()
    if native is None or not hasattr(native, "gemv_q4"):
        return None
    _configure_amx(native)
    return native


@functools.cache
def _configure_amx(native) -> None:
    """Apply TOKENMILL_AMX_MIN_ROWS (once per process) to a build with the AMX path."""
    value = os.environ.get(AMX_MIN_ROWS_ENV)
    if value is None or not hasattr(native, "set_amx_min_rows"):
        return
    try:
        rows = int(value)
        if rows < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{AMX_MIN_ROWS_ENV} must be an integer >= 0 (0: never use AMX), got {value!r}") from None
    native.set_amx_min_rows(rows)


def amx_threshold() -> int:
    """The fewest rows of an int4 / int8 tile step that run on AMX now; 0 where none does (no AMX build, no OS
    permission, or TOKENMILL_AMX_MIN_ROWS=0)."""
    native = kernels()
    if native is None or not hasattr(native, "amx_min_rows"):
        return 0
    rows = native.amx_min_rows()
    return rows if amx_tiles_take(rows) else 0


def amx_tiles_take(rows: int) -> bool:
    """Whether an int4 / int8 tile step of `rows` rows runs on AMX now (csrc/amx_tiles.cpp: built, permitted by
    the OS, at or above amx_min_rows)."""
    native = kernels()
    return native is not None and hasattr(native, "amx_tiles_take") and bool(native.amx_tiles_take(rows))


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
