"""The native small-batch kernels (csrc/gemv_kernels.cpp) that steps of at most MAX_ROWS rows run.

A decode step at batch 1-16 reads every weight once for a few rows of activations. There the native
kernels beat the general ones: for int8/int4 weights, integer dot products with AVX-512 VNNI over
activations quantized to int8 per group of 32 on the fly, where PyTorch's weight-only kernels convert
activations to bfloat16 and are bound by per-row work rather than by the bytes they read; for float32
weights, a tiled GEMV that streams the weight faster than oneDNN or a row-split bmm at these shapes
(benchmarks/decode_latency.py). Above MAX_ROWS rows, and where the CPU has no AVX-512 VNNI, PyTorch's
and oneDNN's kernels run.

Numerics: for int8/int4 the two paths round activations differently (int8 per 32 values vs bfloat16), so
a request's logits depend slightly on whether its step had more than MAX_ROWS rows; float32 stays exact
float32 arithmetic on both (only the summation order differs).
"""
from __future__ import annotations

import torch

from tokenmill.layers import cpu_kernels

MAX_ROWS = 16          # both kernels cost time linear in rows; ours is faster up to here (measured 1-32)


def kernels():
    """The native module if it has the small-batch kernels, else None."""
    native = cpu_kernels.load()
    return native if native is not None and hasattr(native, "gemv_q4") else None


def with_bias(fn, bias: torch.Tensor | None):
    """fn(x) -> y, plus the layer's bias (added in place) if it has one."""
    if bias is None:
        return fn
    return lambda x: fn(x).add_(bias)
