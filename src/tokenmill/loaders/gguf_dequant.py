"""Vectorized torch dequantization of ggml tensor data to float32.

Each quantized type stores a row as consecutive blocks of `block_size` values in `type_size` bytes.
The arithmetic (float32, same operation order) matches `gguf.quants.dequantize`, so results are
bit-exact; tests/loaders/test_gguf.py checks every type against it.

Block layouts (bytes, little-endian; f16 = IEEE half; QK_K = 256):
    Q8_0  34 B / 32 values : d f16 | qs int8[32]                       x = qs * d
    Q4_0  18 B / 32 values : d f16 | qs u8[16]                         x = d * (nibble - 8)
    Q4_1  20 B / 32 values : d f16 | m f16 | qs u8[16]                 x = d * nibble + m
    Q5_0  22 B / 32 values : d f16 | qh u32 | qs u8[16]                x = d * (q5 - 16)
    Q5_1  24 B / 32 values : d f16 | m f16 | qh u32 | qs u8[16]        x = d * q5 + m
          (values 0..15 are the low nibbles of qs, 16..31 the high nibbles; bit j of qh is bit 4 of value j)
    Q4_K 144 B / 256 values: d f16 | dmin f16 | scales u8[12] | qs u8[128]
    Q5_K 176 B / 256 values: d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]
          8 sub-blocks of 32 with 6-bit (scale, min) packed in `scales`; x = (d*scale)*q - dmin*min
    Q6_K 210 B / 256 values: ql u8[128] | qh u8[64] | scales int8[16] | d f16
          16 sub-blocks of 16; x = (d*scale) * (q6 - 32)
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # values per K-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The half-precision scalar at byte `start` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] packed bytes -> [n, 2k] uint8: the k low nibbles, then the k high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _high_bits_32(qh_bytes: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] uint8 bits, bit j of the u32 at column j."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh_bytes.unsqueeze(-1) >> shifts) & 1  # [n, 4 bytes, 8 bits]
    return bits.reshape(-1, 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_high_bits_32(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_high_bits_32(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 12] packed bytes -> (scale, min) each [n, 8] uint8 with 6-bit values.

    Sub-blocks 0..3: low 6 bits of bytes 0..3 (scale) and 4..7 (min).
    Sub-blocks 4..7: low/high nibble of bytes 8..11, plus the top 2 bits of bytes 0..3 / 4..7.
    """
    lo_sc, lo_m, packed = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    scale = torch.cat([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=1)
    minimum = torch.cat([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 2) & 0x30)], dim=1)
    return scale, minimum


def _q4_k_values(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32] 4-bit values; byte chunk c holds sub-blocks 2c (low) and 2c+1 (high)."""
    chunks = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 8, 32)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Shared tail of Q4_K / Q5_K: q [n, 8, 32] -> values [n, 256]."""
    scale, minimum = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * scale.float()).unsqueeze(-1)  # [n, 8, 1]
    dm = (_f16(b, 2) * minimum.float()).unsqueeze(-1)  # [n, 8, 1]
    return (d * q.float() - dm).reshape(-1, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _q4_k_values(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _q4_k_values(b[:, 48:176])
    shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> shifts) & 1  # [n, 8 sub-blocks, 32]: bit i of qh -> sub-block i
    return _k_affine(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values. In half h, 32-value group g (0..3) takes
    #   low 4 bits: ql[h*64 + (g%2)*32 : +32], nibble g//2;  high 2 bits: qh[h*32 : +32], bits 2g..2g+1
    ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(-1, QK_K // 16, 16)
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    return (d * q.float()).reshape(-1, QK_K)


_T = GGMLQuantizationType
_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.Q8_0: _q8_0, _T.Q4_0: _q4_0, _T.Q4_1: _q4_1, _T.Q5_0: _q5_0, _T.Q5_1: _q5_1,
    _T.Q4_K: _q4_k, _T.Q5_K: _q5_k, _T.Q6_K: _q6_k,
}
_FLOAT_DTYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}
SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_FLOAT_DTYPES, *_BLOCK_DEQUANT))


def ggml_type_name(ggml_type: int) -> str:
    """"Q4_1" for 3; "type 99" for an id this gguf package does not know."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def is_supported(ggml_type: int) -> bool:
    return ggml_type_name(ggml_type) in SUPPORTED_TYPES


def row_nbytes(ggml_type: int, row_len: int) -> int:
    """Bytes one row of `row_len` values occupies. The type must be known to the gguf package."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if row_len % block_size:
        raise ValueError(f"row of {row_len} values is not a whole number of {block_size}-value blocks")
    return row_len // block_size * type_size


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of one tensor -> float32 tensor of row-major `shape`.

    raw: uint8, any shape, exactly the tensor's bytes. A writable numpy array is used without a copy.
    """
    data = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    data = data.reshape(-1)
    qtype = GGMLQuantizationType(ggml_type)
    if qtype in _FLOAT_DTYPES:
        return data.view(_FLOAT_DTYPES[qtype]).to(torch.float32).reshape(shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = data.reshape(-1, type_size)  # [n_blocks, type_size]
    return _BLOCK_DEQUANT[qtype](blocks).reshape(shape)
