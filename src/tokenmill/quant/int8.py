"""Weight-only int8: one symmetric scale per output channel, `torch.ops.aten._weight_int8pack_mm`.

    w[n, k] ~= q[n, k] * scale[n],   q int8 in [-127, 127],   scale = max_k |w[n, k]| / 127

The kernel takes per-channel scales only (1-D [N]); group-wise int8 (e.g. GGUF Q8_0's scale per 32)
would need one call per group, so Q8_0 checkpoints are requantized per channel from float32.
Activations: the kernel's vectorized path (AVX2/AVX-512) exists for bfloat16 inputs only; with float32
inputs it runs a scalar loop about 15x slower than float32 F.linear. So x is cast to bfloat16 for the
call (it accumulates in float32) and the result cast back; compute_dtype=torch.float32 gives the exact,
slow path (tests). Where the native tile kernels exist (AVX-512 VNNI) every step runs them instead
(quant/tile_kernels.py: int8 activations per group of 32, integer dot products, 3-4x faster) on the weight
in their tile layout, and that is the only copy kept.
"""
from __future__ import annotations

import torch

from tokenmill.quant import tile_kernels
from tokenmill.quant.base import QuantMethod


class Int8WeightOnlyMethod(QuantMethod):
    name = "int8"
    tile_max_rows = tile_kernels.ANY_ROWS

    def __init__(self, compute_dtype: torch.dtype = torch.bfloat16) -> None:
        self.compute_dtype = compute_dtype

    def uses_tiles(self, layer) -> bool:
        """Whether every step of this layer runs the tile kernel (then no PyTorch copy is kept)."""
        return (self.compute_dtype == torch.bfloat16 and tile_kernels.kernels() is not None
                and layer.in_features % 32 == 0)

    def process_weights_after_loading(self, layer) -> None:
        q, scale = quantize_per_channel_int8(layer.weight.data)
        if self.uses_tiles(layer):
            tiles, padded_scales = pack_q8_tiles(q, scale)
            layer.register_buffer("q8_tiles", tiles, persistent=False)
            layer.register_buffer("q8_tile_scales", padded_scales, persistent=False)
        else:
            layer.register_buffer("qweight", q, persistent=False)                       # [N, K] int8
            layer.register_buffer("scales", scale.to(self.compute_dtype), persistent=False)  # [N]
        self.drop_float_weight(layer)

    def tile_weights(self, layer):
        tiles = getattr(layer, "q8_tiles", None)
        return None if tiles is None else ("q8", tiles, layer.q8_tile_scales)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "qweight", None) is None:
            raise RuntimeError(f"int8 {layer.prefix or 'layer'}: only the tile kernel's copy exists, which "
                               f"Linear.forward runs for every step")
        xc = x.to(self.compute_dtype).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(xc, layer.qweight, layer.scales)      # [T, N]
        return self.add_bias(layer, y.float())


def quantize_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32), symmetric, round to nearest."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def pack_q8_tiles(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N] -> ([ceil(N/16), K/32, 512] int8 tiles, [ceil(N/16) * 16] float32 scales)
    for the native tile kernel (csrc/gemv_kernels.cpp): byte 64c + 4i + j of a tile is row i's
    input 4c + j of the group; rows past N are zero."""
    n, k = q.shape
    blocks = (n + 15) // 16
    pad = blocks * 16 - n
    tiles = torch.nn.functional.pad(q, (0, 0, 0, pad)).view(blocks, 16, k // 32, 8, 4)
    tiles = tiles.permute(0, 2, 3, 1, 4).reshape(blocks, k // 32, 512).contiguous()
    return tiles, torch.nn.functional.pad(scale.float(), (0, pad)).contiguous()
