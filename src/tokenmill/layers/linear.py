"""Linear layers with checkpoint-aware loading. Fused projections (qkv, gate_up) are one weight whose
row ranges are filled from several checkpoint tensors, named by shard id.

The arithmetic is delegated to a quantization method object (tokenmill.quant): F.linear as loaded;
`set_quant_method` switches a loaded layer to its platform's method (float or quantized), which packs the
weight for its kernel (layers/quantize.py does it for a whole model)."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.quant.base import LoadedFloatMethod, QuantMethod

_AS_LOADED = LoadedFloatMethod()


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out_features, in_features] (until a quantization method packs it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias, self.params_dtype = bias, dtype
        self.prefix = ""                              # module name, for error messages
        self.quant_method: QuantMethod = _AS_LOADED
        self.quant_method.create_weights(self)
        self.tile_fn = None                           # x -> y for steps of <= tile_max_rows rows
        self.tile_max_rows = 0

    def set_quant_method(self, method: QuantMethod) -> None:
        """After loading: pack the float weight for `method` and use it from now on."""
        method.process_weights_after_loading(self)
        self.quant_method = method
        self.tile_fn = method.tile_kernel(self)
        self.tile_max_rows = method.tile_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""
        if self.tile_fn is not None and x.shape[0] <= self.tile_max_rows:
            return self.tile_fn(x)
        return self.quant_method.apply(self, x)

    def shard_rows(self, shard_id) -> slice:
        """Rows of the weight that checkpoint shard `shard_id` fills; the whole weight by default."""
        return slice(0, self.out_features)

    def native_decode_linear(self, native):
        """This layer as csrc/decode_layer.cpp's DecodeLinear: the tile kernel its steps of up to
        tile_max_rows rows run and, where the method names one, the kernel `apply` runs for larger steps.
        None without a tile kernel (e.g. w8a8, or float32-compute reference modes)."""
        if self.tile_fn is not None and getattr(self, "q4_tiles", None) is not None:
            kind, weight, scales = "q4", self.q4_tiles, None
        elif self.tile_fn is not None and getattr(self, "q8_tiles", None) is not None:
            kind, weight, scales = "q8", self.q8_tiles, self.q8_tile_scales
        elif self.tile_fn is not None and getattr(self, "f32_tiles", None) is not None:
            kind, weight, scales = "f32", self.f32_tiles, None
        else:
            return None
        bias = None if self.bias is None else self.bias.data
        large = self.quant_method.large_kernel(self)
        # kind "" = no kernel above tile_max_rows (its weight argument is unused)
        large = native.LargeLinear("", weight) if large is None else native.LargeLinear(*large)
        return native.DecodeLinear(kind, weight, scales, bias, self.out_features, self.tile_max_rows,
                                   large)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output: e.g. q|k|v or gate|up."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype)
        self.shard_sizes = dict(shard_sizes)
        offsets, start = {}, 0
        for name, size in shard_sizes.items():
            offsets[name] = slice(start, start + size)
            start += size
        self.offsets = offsets

    def shard_rows(self, shard_id) -> slice:
        return self.offsets[shard_id]

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """y [..., out_features] -> the per-shard views, in declaration order."""
        return list(y.split(list(self.shard_sizes.values()), dim=-1))
