"""Linear layers with checkpoint-aware loading. Fused projections (qkv, gate_up) are one weight whose
row ranges are filled from several checkpoint tensors, named by shard id.

The arithmetic is delegated to a quantization method object (tokenmill.quant): float32 by default;
`set_quant_method` switches a loaded layer to another method, which packs the weight for its kernel."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.quant import small_batch
from tokenmill.quant.base import QuantMethod
from tokenmill.quant.unquantized import UnquantizedMethod

_UNQUANTIZED = UnquantizedMethod()


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out_features, in_features] (until a quantization method packs it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias, self.params_dtype = bias, dtype
        self.prefix = ""                              # module name, for error messages
        self.quant_method: QuantMethod = _UNQUANTIZED
        self.quant_method.create_weights(self)
        self.small_batch_fn = None                    # x -> y for steps of <= small_batch.MAX_ROWS rows

    def set_quant_method(self, method: QuantMethod) -> None:
        """After loading: pack the float weight for `method` and use it from now on."""
        method.process_weights_after_loading(self)
        self.quant_method = method
        self.small_batch_fn = method.small_batch_kernel(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""
        if self.small_batch_fn is not None and x.shape[0] <= small_batch.MAX_ROWS:
            return self.small_batch_fn(x)
        return self.quant_method.apply(self, x)

    def shard_rows(self, shard_id) -> slice:
        """Rows of the weight that checkpoint shard `shard_id` fills; the whole weight by default."""
        return slice(0, self.out_features)

    def native_decode_linear(self, native):
        """This layer as csrc/decode_layer.cpp's DecodeLinear (the same kernel its small steps run), or None
        where no native equivalent exists (e.g. w8a8, or float32-compute reference modes)."""
        if self.small_batch_fn is not None and getattr(self, "q4_tiles", None) is not None:
            kind, weight, scales = "q4", self.q4_tiles, None
        elif self.small_batch_fn is not None and getattr(self, "q8_tiles", None) is not None:
            kind, weight, scales = "q8", self.q8_tiles, self.q8_tile_scales
        elif self.small_batch_fn is not None and getattr(self, "f32_tiles", None) is not None:
            kind, weight, scales = "f32", self.f32_tiles, None
        else:
            return None
        bias = None if self.bias is None else self.bias.data
        return native.DecodeLinear(kind, weight, scales, bias, self.out_features)


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
