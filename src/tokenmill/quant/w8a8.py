"""Dynamic W8A8: int8 weights (symmetric, per output channel), activations quantized to 8 bits per
call (one affine scale per tensor, from its min/max), int8 x int8 GEMM with int32 accumulation in
fbgemm (`torch.ops.quantized.linear_dynamic` on prepacked weights), float32 out.

reduce_range=True quantizes activations to 7 bits: fbgemm's AVX2 kernel sums pairs of u8*s8 products
in int16 (vpmaddubsw), which can saturate with full 8-bit activations; 7 bits cannot.
"""
from __future__ import annotations

import warnings

import torch

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.int8 import quantize_per_channel_int8


class W8A8DynamicMethod(QuantMethod):
    name = "w8a8"
    reduce_range = True

    def process_weights_after_loading(self, layer) -> None:
        q, scale = quantize_per_channel_int8(layer.weight.data)
        zeros = torch.zeros(layer.out_features, dtype=torch.long)
        bias = None if layer.bias is None else layer.bias.data.float()
        with warnings.catch_warnings():   # quantized tensor dtypes are deprecated; fbgemm still takes them
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
            layer.w8a8_packed = torch.ops.quantized.linear_prepack(qw, bias)   # fbgemm packed [N, K] + bias
        self.drop_float_weight(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.contiguous(), layer.w8a8_packed, self.reduce_range)
