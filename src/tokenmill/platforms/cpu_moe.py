"""The CPU's grouped expert GEMM (csrc/moe_kernels.cpp, AVX2 + FMA) as a layers/moe kernel: each expert's
gate|up and down weights stacked [E, N, K] (float32, or int8 with a float32 scale per output row, as the
int8 method quantized them), the step's rows sorted by expert, one native call per projection. The
per-expert Linears' own copies are dropped once stacked."""
from __future__ import annotations

import torch

from tokenmill.layers.moe.kernels import MoEKernel
from tokenmill.platforms import cpu_native


def _stackable(layer) -> str | None:
    """"float" or "int8" when the kernel can take this expert layer's weights as they are; else None."""
    if layer.has_bias or layer.in_features % 8:
        return None
    if layer.quant_method.is_float and layer.weight is not None and layer.weight.dtype == torch.float32:
        return "float"
    if getattr(layer, "qweight", None) is not None and layer.qweight.dtype == torch.int8 \
            and getattr(layer, "scales", None) is not None:
        return "int8"
    return None


def supports(moe) -> bool:
    native = cpu_native.load()
    if native is None or not hasattr(native, "moe_grouped_gemm"):
        return False
    kinds = {_stackable(layer) for e in moe.local_experts() for layer in (e.gate_up_proj, e.down_proj)}
    return len(kinds) == 1 and None not in kinds


class CPUGroupedGemm(MoEKernel):
    name = "cpu_grouped"

    def prepare(self, moe) -> None:
        if not supports(moe):
            raise ValueError("the cpu_grouped MoE kernel needs the native build (AVX2 + FMA) and float32 or "
                             "int8 expert weights without bias, inputs a multiple of 8")
        experts = moe.local_experts()
        for name, attr in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            layers = [getattr(e, attr) for e in experts]
            if _stackable(layers[0]) == "float":
                moe.register_buffer(name, torch.stack([layer.weight.data for layer in layers]), persistent=False)
                setattr(moe, name + "_scale", None)
                for layer in layers:
                    layer.weight = None
            else:
                moe.register_buffer(name, torch.stack([layer.qweight for layer in layers]), persistent=False)
                moe.register_buffer(name + "_scale", torch.stack([layer.scales.float() for layer in layers]),
                                    persistent=False)
                for layer in layers:
                    layer.qweight = None
        self.native = cpu_native.load()
        self.act_and_mul = experts[0].act_and_mul

    def __call__(self, moe, x, experts):
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=moe.num_local)
        starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        xs = x.index_select(0, order).float().contiguous()
        h = self.native.moe_grouped_gemm(xs, starts, moe.w13, moe.w13_scale)
        ys = self.native.moe_grouped_gemm(self.act_and_mul(h).contiguous(), starts, moe.w2, moe.w2_scale)
        y = torch.empty_like(ys)
        y[order] = ys
        return y.to(x.dtype)
