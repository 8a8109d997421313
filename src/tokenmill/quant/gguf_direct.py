"""GGUF block formats a quant method's packed form takes as they are (layers/quantize.py load_gguf_direct
reads them from the file).

A method lists the block types it takes in `direct_gguf_types`; CONVERTERS turns a tensor's blocks into
the arguments of its `set_packed`:
    Q4_1 -> int4  (q, scale, zero), exact: x = d*q + m  ==  (q - 8)*d + (m + 8*d), the kernel's
                  (q - 8)*scale + zero with group 32; m + 8*d of two float16s is exact in float32 (checked
                  per tensor, else the tensor goes the float32 way), and the kernel's fused multiply-add
                  then rounds once, like the dequantizer. tests/quant/test_gguf_direct.py checks it bit
                  for bit. CPU and CUDA int4.
    Q8_0 -> int8  (q, d), exact: x = q * d per 32 values. CUDA int8 only (group scales); the CPU's int8
                  kernels take one scale per output channel, so there Q8_0 is dequantized and requantized.
Every other tensor (norms, embeddings, other types) is dequantized and loaded as usual.
"""
from __future__ import annotations

import numpy as np
import torch

Q4_1_BLOCK_BYTES, Q4_1_BLOCK = 20, 32      # d f16 | m f16 | 16 bytes of nibbles, per 32 values
Q8_0_BLOCK_BYTES, Q8_0_BLOCK = 34, 32      # d f16 | 32 int8 values


def q4_1_to_int4(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]):
    """Q4_1 rows raw uint8 [N, K/32*20] -> (q [N, K] uint8 0..15, scale [N, K/32], zero [N, K/32] float32)
    with d*q + m == (q - 8)*scale + zero. Returns None if some m + 8*d is not exact in float32."""
    n, k = shape
    b = torch.from_numpy(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    b = b.reshape(n, k // Q4_1_BLOCK, Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()            # [N, K/32]
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = b[..., 4:]                                                                   # [N, K/32, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)    # low nibbles = values 0..15 of a block
    zero = m + 8.0 * d
    if not torch.equal(zero.double(), m.double() + 8.0 * d.double()):
        return None
    return q, d, zero


def q8_0_to_int8(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]):
    """Q8_0 rows raw uint8 [N, K/32*34] -> (q [N, K] int8, d [N, K/32] float32) with x = q * d."""
    n, k = shape
    b = torch.from_numpy(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    b = b.reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()            # [N, K/32]
    q = b[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return q, d


CONVERTERS = {"Q4_1": q4_1_to_int4, "Q8_0": q8_0_to_int8}   # ggml type -> raw rows, shape -> set_packed args
BLOCK_BYTES = {"Q4_1": Q4_1_BLOCK_BYTES, "Q8_0": Q8_0_BLOCK_BYTES}
GGUF_BLOCK = 32                                               # values per block of both
