"""Dynamic W8A8: int8 weights (symmetric, per output channel), activations quantized to 8 bits per
call (one affine scale per tensor, from its min/max), int8 x int8 GEMM with int32 accumulation in
fbgemm (`torch.ops.quantized.linear_dynamic` on prepacked weights), float32 out.

Where it pays: per-tensor activation scales are fine for o_proj (input: attention output) and gate|up
(input: RMSNorm output), which hold 2/3 of a layer's weights. Measured alone on the default model
(perplexity of tests/quant/data/ppl_text.txt vs fp32, 8-bit activations): o_proj +0.0%, gate_up +1.9%,
qkv_proj +1.2%, down_proj +56% (its input silu(gate) * up has outlier channels), lm_head +1.8%. So
qkv_proj, down_proj and the lm_head use weight-only int8 (quant/int8.py); all together +1.9%.
reduce_range (7-bit activations) where the CPU lacks VNNI: fbgemm's AVX2 kernel sums pairs of u8*s8
products in int16 (vpmaddubsw), which full 8-bit activations can saturate; VNNI accumulates in int32.
"""
from __future__ import annotations

import functools
import warnings

import torch

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.int8 import quantize_per_channel_int8

WEIGHT_ONLY_LAYERS = ("down_proj", "qkv_proj")


@functools.cache
def cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class W8A8DynamicMethod(QuantMethod):
    name = "w8a8"
    lm_head_method = "int8"

    def __init__(self, reduce_range: bool | None = None) -> None:
        self.reduce_range = (not cpu_has_vnni()) if reduce_range is None else reduce_range

    def method_for(self, prefix: str) -> str | None:
        if prefix.split(".")[-1] in WEIGHT_ONLY_LAYERS:
            return "int8"
        return super().method_for(prefix)

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
