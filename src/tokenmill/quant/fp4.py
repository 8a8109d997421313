"""FP4 (E2M1) weights on the CPU, NVFP4 and MXFP4: 4 bits a weight, two per byte (the even element in the low
nibble, as ModelOpt, compressed-tensors and the OCP MX spec pack them), decoded to float32 in the kernel
(csrc/moe_kernels.cpp's grouped GEMM with one group), times a float32 scale per output row and block:

    w[n, k] = e2m1[n, k] * scale[n, k // block]
    E2M1 magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (and their negatives)

- NVFP4: blocks of 16; scale = an E4M3 block scale x one float32 tensor scale. Quantizing a float weight
  (as ModelOpt does): tensor scale = amax / (6 x 448), block scale = E4M3(block amax / 6 / tensor scale).
- MXFP4: blocks of 32; scale = 2^e with e an E8M0 exponent: floor(log2(block amax)) - 2 (E2M1's largest
  exponent), so the block's largest value lands in [4, 8) before rounding (6 at most, saturating).

Activations stay float32 there: the exact reference of each format. Without the native build, `apply`
dequantizes per call (slow, exact). A tied head gets an int8 copy, as with int4 and fp8.

The fast mode of both, where the native tile kernels exist (AVX-512 VNNI, quant/tile_kernels.py): every step
runs csrc/gemv_kernels.cpp's gemv_nvfp4 over the weight in its tile layout (`fp4_tiles`, 4.5 bits a weight:
the codes and E4M3 scale bytes, the only copy then kept), with activations quantized to int8 per 32 as
int4's tiles take them; 2 x E2M1 is an integer, so the products are exact integer dot products and the one
difference from the reference is the activations' int8 rounding. MXFP4 enters it through
`mxfp4_as_nvfp4`: its power-of-two scale of each block of 32 is the same E4M3 scale on both halves under a
power-of-two row scale, exact while a row's scales span at most 2^17 (a layer where they do not keeps the
grouped kernel). `NVFP4Method(int8_activations=False)` (and MXFP4's) keeps the float32-activation
reference instead (the class attribute of that name sets it for every engine built after).
"""
from __future__ import annotations

import torch

from tokenmill.quant import tile_kernels
from tokenmill.quant.base import QuantMethod

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit codes (uint8 0..15: sign in bit 3), round to nearest, ties to the even code, saturating."""
    mag = x.abs().clamp(max=E2M1_MAX)
    mid = _MIDPOINTS.to(x.device)
    idx = torch.searchsorted(mid, mag.contiguous())                   # first midpoint >= mag
    tie = (idx < 7) & (mag == mid[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)             # a tie goes to the even code
    return (idx | torch.where(x < 0, 8, 0)).to(torch.uint8)


def from_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) -> float32."""
    value = E2M1_VALUES.to(codes.device)[(codes & 7).long()]
    return torch.where(codes & 8 != 0, -value, value)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (K even) -> bytes [..., K / 2]: element 2i in the low nibble of byte i."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K / 2] -> codes [..., K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """bytes [n, K / 2], scales [n, K / block] float32 -> weights [n, K] float32."""
    return from_e2m1(unpack(packed)) * scales.repeat_interleave(block, dim=1)


def nvfp4_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, K] -> (E4M3 block scales [n, K / 16] as float8_e4m3fn, float32 tensor scale [1])."""
    tensor_scale = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
    amax = w.reshape(w.shape[0], -1, 16).abs().amax(dim=2)
    return (amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn), tensor_scale


def mxfp4_exponents(w: torch.Tensor) -> torch.Tensor:
    """w [n, K] -> E8M0 block exponents [n, K / 32] (uint8, biased by 127: scale = 2^(e - 127))."""
    amax = w.reshape(w.shape[0], -1, 32).abs().amax(dim=2)
    e = torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2
    return (e + 127).clamp(0, 254).to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.float() - 127)


def mxfp4_as_nvfp4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """MXFP4 codes [N, K / 2] with power-of-two scales [N, K / 32] float32 -> the same weights as NVFP4 keeps
    them: (E4M3 block scales [N, K / 16], each block of 32's scale twice; float32 row scale [N] = 2^(m - 8),
    m = log2 of the row's largest scale). E4M3 holds every power of two from 2^-9 (a subnormal) to 2^8, so
    a block is exact where its scale is within 2^17 of its row's largest; a block of zero codes may take any
    scale (its weights are 0 whatever it is). None where a block holding a nonzero code falls outside, or
    a scale is not a power of two."""
    n, groups = scales.shape
    exponent = torch.log2(scales.float())
    if not bool(torch.isfinite(exponent).all()) or not torch.equal(exponent.round(), exponent):
        return None
    holds_value = (unpack(packed).view(n, groups, 32) & 7).amax(dim=2) > 0               # [N, K / 32]
    top = torch.where(holds_value, exponent, float("-inf")).amax(dim=1)
    top = torch.where(torch.isfinite(top), top, 0.0)                  # a row of zeros: any scale
    relative = exponent - top[:, None] + 8                             # the E4M3 scale's exponent
    if bool((holds_value & (relative < -9)).any()):
        return None
    block_scale = torch.exp2(relative.clamp(-9, 8)).to(torch.float8_e4m3fn).repeat_interleave(2, dim=1)
    return block_scale, torch.exp2(top - 8)


def quantize(w: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """w [n, K] / its float32 scales [n, K / block] -> packed codes [n, K / 2] (a zero scale gives code 0)."""
    full = scales.repeat_interleave(block, dim=1)
    return pack(to_e2m1(torch.where(full > 0, w / full.clamp_min(torch.finfo(torch.float32).tiny), 0.0)))


def pack_nvfp4_tiles(packed: torch.Tensor, scale_codes: torch.Tensor, row_scale: torch.Tensor):
    """NVFP4 codes [N, K / 2] (two a byte), E4M3 block scales [N, K / 16] (float8_e4m3fn) and tensor scale per
    row [N] -> gemv_nvfp4's tiles [ceil(N / 16), K / 32, 288] uint8 (layout in csrc/gemv_kernels.cpp: the
    codes in int4 tiles' nibble order, then per half group the 16 rows' scale bytes) and its row scale
    [ceil(N / 16) * 16] float32 = tensor scale x 2^8 / 2 (what the kernel's decoding leaves out). A negative
    block scale is stored as its magnitude with its block's codes negated (E2M1's sign bit flipped): exact."""
    from tokenmill.quant.int4 import pack_q4_tiles
    n, k = packed.shape[0], 2 * packed.shape[1]
    blocks, groups = -(-n // 16), k // 32
    scale_bytes = scale_codes.view(torch.uint8)
    negative = (scale_bytes & 0x80) != 0                                             # [N, K / 16]
    codes = unpack(packed).view(n, k // 16, 16) ^ (negative.to(torch.uint8) * 8).unsqueeze(-1)
    zeros = torch.zeros(n, groups)
    nibbles = pack_q4_tiles(codes.view(n, k), zeros, zeros)[..., :256]              # [B, G, 256]
    s = torch.zeros(blocks * 16, groups * 2, dtype=torch.uint8)
    s[:n] = scale_bytes & 0x7F
    s = s.view(blocks, 16, groups, 2).permute(0, 2, 3, 1).reshape(blocks, groups, 32)   # [B, G, (half, row)]
    rows = torch.zeros(blocks * 16)
    rows[:n] = row_scale.float().reshape(-1) * 128.0
    return torch.cat([nibbles, s], dim=2).contiguous(), rows


def assemble_codes(layer, codes: list, name: str) -> torch.Tensor:
    """A layer's packed codes [N, K / 2] from its shards': codes = [(rows of the layer, uint8 [n, K / 2])]
    covering the layer."""
    packed = torch.empty(layer.out_features, layer.in_features // 2, dtype=torch.uint8)
    for rows, c in codes:
        if c.dtype != torch.uint8 or c.shape != packed[rows].shape:
            raise ValueError(f"{layer.prefix or 'a linear layer'}: an {name.upper()} weight must be uint8 "
                             f"{tuple(packed[rows].shape)} (two codes a byte), got {c.dtype} {tuple(c.shape)}")
        packed[rows] = c
    return packed


class FP4Method(QuantMethod):
    """The shared part of NVFP4 and MXFP4: packed E2M1 codes [1, N, K / 2] (`fp4_weight`) and their scales
    (`fp4_scale`): float32 [1, N, K / block], or, where every row's scales are E4M3 values times one tensor
    scale (NVFP4), float8_e4m3fn [1, N, K / block] with `fp4_row_scale` float32 [1, N] (a quarter of the
    scale bytes; the kernel multiplies them back). The grouped GEMM kernel runs on them.

    The fast mode (`int8_activations`, where the tile kernels exist): a layer whose scales read as E4M3 blocks
    of 16 under a row scale (tile_scales) keeps only gemv_nvfp4's tiles and runs them at every step size."""
    block = 0
    quantize_tied_lm_head = True
    lm_head_method = "int8"          # as int4 and fp8: the head is the layer most sensitive to weight error
    tile_max_rows = tile_kernels.ANY_ROWS
    int8_activations = False

    def __init__(self, int8_activations: bool | None = None) -> None:
        if int8_activations is not None:
            self.int8_activations = int8_activations

    def tile_scales(self, layer) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This layer's scales as gemv_nvfp4's tiles hold them: (E4M3 block scales [N, K / 16] float8_e4m3fn,
        float32 row scale [N]) giving back exactly the scales it has, or None where they cannot."""
        return None

    def uses_tiles(self, layer) -> bool:
        """Whether every step of this layer may run gemv_nvfp4: the fast mode, the kernels, 32 | in_features."""
        return self.int8_activations and tile_kernels.kernels() is not None and layer.in_features % 32 == 0

    def check_shape(self, layer) -> None:
        if layer.in_features % self.block:
            raise ValueError(f"{self.name} quantization of {layer.prefix or 'a linear layer'} [{layer.out_features}, "
                             f"{layer.in_features}] needs in_features a multiple of {self.block}")

    def block_scales(self, w: torch.Tensor) -> torch.Tensor:
        """w [n, K] float32 -> the float32 scale of every block [n, K / block]."""
        raise NotImplementedError

    def tensor_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        """The one float32 scale block_scales(w) are E4M3 multiples of (NVFP4), else None."""
        return None

    def checkpoint_scales(self, layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pre-quantized checkpoint's scales [N, K / block] and, where each shard gives one, the tensor scale
        of each row [N] (quant/prequantized.py attaches `checkpoint_fp4`: per shard, its rows in the layer,
        their scales, and their tensor scale or None)."""
        scales = torch.full((layer.out_features, layer.in_features // self.block), float("nan"))
        rows_scale = torch.full((layer.out_features,), float("nan"))
        for rows, part, tensor_scale in layer.checkpoint_fp4:
            scales[rows] = part
            if tensor_scale is not None:
                rows_scale[rows] = tensor_scale
        if torch.isnan(scales).any():
            raise ValueError(f"{layer.prefix or 'a linear layer'}: the checkpoint gives FP4 scales for only some of "
                             "its rows (a fused layer with a part the checkpoint keeps in float is not supported)")
        return scales, None if torch.isnan(rows_scale).any() else rows_scale

    def process_weights_after_loading(self, layer) -> None:
        given = getattr(layer, "fp4_weight", None) is not None or getattr(layer, "fp4_tiles", None) is not None
        if not given:                                            # not already given the checkpoint's codes
            w = layer.weight.data.float()
            if getattr(layer, "checkpoint_fp4", None):
                scales, rows_scale = self.checkpoint_scales(layer)
            else:
                scales, t = self.block_scales(w), self.tensor_scale(w)
                rows_scale = None if t is None else t.reshape(1).expand(w.shape[0])
            self._register(layer, quantize(w, scales, self.block), scales, rows_scale)
        self.drop_float_weight(layer)

    def set_codes(self, layer, codes: list, device: torch.device) -> None:
        """The checkpoint's own codes, kept as they are (no float copy), with the scales of `checkpoint_fp4`."""
        self._register(layer, assemble_codes(layer, codes, self.name), *self.checkpoint_scales(layer))

    def _register(self, layer, packed: torch.Tensor, scales: torch.Tensor, rows_scale: torch.Tensor | None) -> None:
        self._keep_codes(layer, packed, scales, rows_scale)
        self._pack_tiles(layer)

    @staticmethod
    def _keep_codes(layer, packed: torch.Tensor, scales: torch.Tensor, rows_scale: torch.Tensor | None) -> None:
        """packed [N, K/2]; scales [N, K/block] float32; rows_scale [N]: scales are E4M3 values times it (then
        kept as E4M3 bytes where that gives them back to float32 rounding), or None."""
        layer.register_buffer("fp4_weight", packed.unsqueeze(0).contiguous(), persistent=False)          # [1, N, K/2]
        scales = scales.float()
        if rows_scale is not None and bool((rows_scale > 0).all()):
            rows = rows_scale.float().reshape(-1, 1)
            codes = (scales / rows).to(torch.float8_e4m3fn)
            if torch.allclose(codes.float() * rows, scales, rtol=1e-6, atol=0.0):
                layer.register_buffer("fp4_scale", codes.unsqueeze(0).contiguous(), persistent=False)
                layer.register_buffer("fp4_row_scale", rows.reshape(1, -1).contiguous(), persistent=False)
                return
        layer.register_buffer("fp4_scale", scales.unsqueeze(0).contiguous(), persistent=False)            # [1, N, K/b]
        layer.fp4_row_scale = None

    def _pack_tiles(self, layer) -> None:
        """In the fast mode, the tiles become the layer's only copy of its weight (where its scales allow)."""
        found = self.tile_scales(layer) if self.uses_tiles(layer) else None
        if found is None:
            return
        tiles, tile_scale = pack_nvfp4_tiles(layer.fp4_weight[0], *found)
        layer.register_buffer("fp4_tiles", tiles, persistent=False)
        layer.register_buffer("fp4_tile_scale", tile_scale, persistent=False)
        del layer.fp4_weight, layer.fp4_scale, layer.fp4_row_scale                # the tiles are the copy

    def tile_weights(self, layer):
        tiles = getattr(layer, "fp4_tiles", None)
        return None if tiles is None else ("nvfp4", tiles, layer.fp4_tile_scale)

    @staticmethod
    def float_scales(layer) -> torch.Tensor:
        """The layer's scales as float32 [N, K / block], whichever form it keeps them in."""
        scales = layer.fp4_scale[0].float()
        return scales if layer.fp4_row_scale is None else scales * layer.fp4_row_scale[0].reshape(-1, 1)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "fp4_tiles", None) is not None:
            return self.add_bias(layer, tile_kernels.kernels().gemv_nvfp4(x.float().contiguous(), layer.fp4_tiles,
                                                                          layer.fp4_tile_scale, layer.out_features))
        from tokenmill.quant.fp8 import grouped_linear
        y = grouped_linear(x, layer.fp4_weight, layer.fp4_scale, self.block,
                           lambda: dequantize(layer.fp4_weight[0], self.float_scales(layer), self.block),
                           row_scale=layer.fp4_row_scale)
        return self.add_bias(layer, y)


class NVFP4Method(FP4Method):
    name = "nvfp4"
    block = 16
    int8_activations = True            # the fast mode where the tile kernels exist (the default for every engine)

    def tile_scales(self, layer):
        """The tiles take NVFP4's own scales where they are kept as E4M3 bytes times a row scale."""
        if layer.fp4_scale.dtype != torch.float8_e4m3fn:
            return None
        return layer.fp4_scale[0], layer.fp4_row_scale[0]

    def block_scales(self, w: torch.Tensor) -> torch.Tensor:
        block_scale, tensor_scale = nvfp4_scales(w)
        return block_scale.float() * tensor_scale

    def tensor_scale(self, w: torch.Tensor) -> torch.Tensor:
        return nvfp4_scales(w)[1]


class MXFP4Method(FP4Method):
    name = "mxfp4"
    block = 32
    int8_activations = True            # the fast mode where the tile kernels exist (the default for every engine)

    def tile_scales(self, layer):
        """MXFP4's power-of-two scales re-expressed as NVFP4's (mxfp4_as_nvfp4), where that is exact."""
        return mxfp4_as_nvfp4(layer.fp4_weight[0], layer.fp4_scale[0])

    def block_scales(self, w: torch.Tensor) -> torch.Tensor:
        return e8m0_to_float(mxfp4_exponents(w))
