"""Which quantized layers run the native small-batch kernels (csrc/gemv_kernels.cpp).

A decode step at batch 1-16 reads every weight once for a few rows of activations: there the native
kernels (integer dot products with AVX-512 VNNI, activations quantized to int8 per group of 32 on the fly)
beat PyTorch's weight-only kernels, which convert activations to bfloat16 and, at these shapes, are bound
by per-row work rather than by the bytes they read (benchmarks/decode_latency.py). Above
`MAX_ROWS` rows, and where the CPU has no AVX-512 VNNI, PyTorch's kernels run.

Numerics: the two paths round activations differently (int8 per 32 values vs bfloat16), so a request's
logits in int8/int4 mode depend slightly on whether its step had more than MAX_ROWS rows; float32 weights
never take this path.
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
