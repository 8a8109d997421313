"""Dynamic W8A8: int8 weights (symmetric, per output channel) and int8 activations quantized on the fly
with one symmetric scale per token (row), int8 x int8 GEMM with int32 accumulation (`torch._int_mm`,
oneDNN with VNNI: 750-870 GFLOP/s here against about 220 for the fp32 GEMM), float32 out.

Per-token scales keep every row's result independent of the other rows in the batch, so a request gets
the same tokens whatever shares its step (fbgemm's dynamic linear uses one scale for the whole batch and
does not). On AVX-512 VNNI CPUs weight-only int8/int4 now run faster at every batch size (their tile
kernels: Offline 543-580 tok/s against 360 for w8a8 on the peer workload), so this mode matters where
those kernels are missing. o_proj and gate|up (inputs: attention output, RMSNorm output) take int8
activations. qkv_proj (int8 activations there cost about as much perplexity as the other two together),
down_proj (its input silu(gate) * up has outlier channels: +56% perplexity with 8-bit activations) and the
lm_head stay float32 (tiles and oneDNN, as in the fp32 mode): PyTorch's weight-only int8 kernel, the one
available where the tile kernels are not, runs batches at a fraction of the fp32 GEMM's speed.
Figures: benchmarks/quant_quality.py, benchmarks/offline_throughput.py --quantization w8a8.
"""
from __future__ import annotations

import torch

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.int8 import quantize_per_channel_int8

FLOAT_LAYERS = ("down_proj", "qkv_proj")


class W8A8DynamicMethod(QuantMethod):
    name = "w8a8"
    lm_head_method = "float"

    def method_for(self, prefix: str) -> str | None:
        if prefix.split(".")[-1] in FLOAT_LAYERS:
            return "float"
        return super().method_for(prefix)

    def process_weights_after_loading(self, layer) -> None:
        q, scale = quantize_per_channel_int8(layer.weight.data)
        layer.w8a8_weight_t = q.t()                    # [K, N] int8 (a transposed view: _int_mm takes it as is)
        layer.w8a8_weight_scale = scale                # [N] float32
        self.drop_float_weight(layer)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 -> [T, N] float32."""
        x = x.float()
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)    # [T, 1]
        xq = torch.round(x / x_scale).to(torch.int8)                                   # [T, K], |xq| <= 127
        y = torch._int_mm(xq, layer.w8a8_weight_t)                                    # [T, N] int32
        out = torch.mul(y, x_scale).mul_(layer.w8a8_weight_scale)
        return self.add_bias(layer, out)
