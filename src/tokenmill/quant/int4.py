"""Weight-only int4 with a scale and zero point per 32 inputs, PyTorch's CPU int4 kernels
(`_convert_weight_to_int4pack_for_cpu` + `_weight_int4pack_mm_for_cpu`).

Kernel convention (checked bit for bit in tests/quant): for q in 0..15 of group g = k // 32,
    w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],    scales_and_zeros [K/32, N, 2] = (scale, zero)
GGUF Q4_1 stores w = d * q + m per 32 values, so it maps exactly with scale = d, zero = m + 8 d
(see quant/gguf_blocks.py); from float32 we quantize the same way Q4_1 does (min/max per group).
Activations: as for int8, the kernel's vectorized path takes bfloat16 only (float32 runs a scalar loop
about 30x slower), so x, scale and zero are bfloat16 in the call; accumulation is float32 inside.
Shapes: out_features a multiple of 16 and in_features a multiple of 32.

Where the native tile kernels exist (AVX-512 VNNI, quant/tile_kernels.py) every step runs them instead, on
the weight in their tile layout (`q4_tiles`, with Q4_1's float16 d and m = zero - 8 * scale per group;
exact for GGUF Q4_1), the only copy then kept: 2-4x faster than the PyTorch kernel from 1 to 512 rows.
"""
from __future__ import annotations

import torch

from tokenmill.quant import tile_kernels
from tokenmill.quant.base import QuantMethod

GROUP_SIZE = 32


class Int4WeightOnlyMethod(QuantMethod):
    name = "int4"
    direct_gguf_types = ("Q4_1",)
    tile_max_rows = tile_kernels.ANY_ROWS
    lm_head_method = "int8"   # int4 lm_head: default model perplexity +4.5%; int8 head: about +0.2%

    def __init__(self, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        self.compute_dtype = compute_dtype

    def check_shape(self, layer) -> None:
        if layer.out_features % 16 or layer.in_features % GROUP_SIZE:
            raise ValueError(f"int4 quantization of {layer.prefix or 'a linear layer'} "
                             f"[{layer.out_features}, {layer.in_features}] needs out_features a multiple "
                             f"of 16 and in_features a multiple of {GROUP_SIZE}")

    def uses_tiles(self) -> bool:
        """Whether every step runs the tile kernel (then no PyTorch copy is kept); in_features % 32 == 0
        holds for every int4 layer (check_shape)."""
        return self.compute_dtype == torch.bfloat16 and tile_kernels.kernels() is not None

    def process_weights_after_loading(self, layer) -> None:
        filled = getattr(layer, "int4_packed", None) is not None or getattr(layer, "q4_tiles", None) is not None
        if not filled:                                                 # not already filled from GGUF blocks
            q, scale, zero = quantize_groupwise_int4(layer.weight.data)
            self.set_packed(layer, q, scale, zero)
        self.drop_float_weight(layer)

    def set_packed(self, layer, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """q [N, K] int 0..15; scale, zero [N, K/32] float32 in the kernel's convention."""
        if self.uses_tiles():
            layer.register_buffer("q4_tiles", pack_q4_tiles(q, scale, zero - 8.0 * scale), persistent=False)
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(self.compute_dtype).contiguous()  # [K/32, N, 2]
        layer.register_buffer("int4_packed", packed, persistent=False)              # [N, K/2] uint8
        layer.register_buffer("scales_and_zeros", sz, persistent=False)

    def tile_weights(self, layer):
        tiles = getattr(layer, "q4_tiles", None)
        return None if tiles is None else ("q4", tiles, None)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "int4_packed", None) is None:
            raise RuntimeError(f"int4 {layer.prefix or 'layer'}: only the tile kernel's copy exists, which "
                               f"Linear.forward runs for every step")
        xc = x.to(self.compute_dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, layer.int4_packed, GROUP_SIZE,
                                                       layer.scales_and_zeros)      # [T, N]
        return self.add_bias(layer, y.float())


def quantize_groupwise_int4(w: torch.Tensor, group_size: int = GROUP_SIZE):
    """w [N, K] float -> (q [N, K] uint8 0..15, scale [N, K/g], zero [N, K/g]) float32 with
    w ~= (q - 8) * scale + zero: min/max per group (the Q4_1 recipe, whose d = scale and m = min are
    float16: rounded to float16 first, so both kernels' layouts hold them exactly), round to nearest."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=-1).half().float()                                               # [N, K/g]
    scale = ((g.amax(dim=-1) - lo) / 15.0).half().float().clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8.0 * scale


def pack_q4_tiles(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q [N, K] 0..15, d, m [N, K/32] (w = d * q + m) -> [ceil(N/16), K/32, 320] uint8 tiles of the native
    tile kernel (layout in csrc/gemv_kernels.cpp): per 16 rows x 32 inputs, 256 bytes of nibbles
    (byte 4i + j of chunk c: row i's inputs 8c + j low, 8c + 4 + j high), then d and m as float16."""
    n, k = q.shape
    groups, blocks = k // GROUP_SIZE, (n + 15) // 16
    pad = blocks * 16 - n                                               # zero rows complete the last block
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).view(blocks, 16, groups, 4, 2, 4)
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4))                      # [B, 16 rows, G, 4 chunks, 4]
    nibbles = nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256)
    halves = [torch.nn.functional.pad(t.float(), (0, 0, 0, pad)).to(torch.float16).view(blocks, 16, groups)
              .transpose(1, 2).contiguous().view(torch.uint8) for t in (d, m)]   # [B, G, 32] each
    return torch.cat([nibbles] + halves, dim=-1).contiguous()
