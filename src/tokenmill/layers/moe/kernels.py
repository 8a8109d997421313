"""How a FusedMoE computes its experts over a step's (token, expert) rows: a base class and a registry.

    kernel(moe, x [N, hidden], experts [N] local expert index) -> [N, hidden], row i = expert(x[i])

- "grouped_linears" (every platform, every quantization method): the rows sorted by expert, one call of
  each expert's two Linears on its contiguous run. Each expert's weights are read once per step.
- "triton" (CUDA, float experts): the experts' weights stacked [E, N, K] and one grouped-GEMM launch per
  projection over the sorted rows (triton_moe.py): no host sync, no per-expert launches.
- "cpu_grouped" (CPU with AVX2, float32 or int8 experts): the same stacking, one native call per
  projection (platforms/cpu_moe.py, csrc/moe_kernels.cpp).
"""
from __future__ import annotations

import torch


class MoEKernel:
    name = "base"

    def prepare(self, moe) -> None:
        """Once, after the experts are loaded and quantized: repack what the kernel reads."""

    def __call__(self, moe, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class GroupedLinears(MoEKernel):
    name = "grouped_linears"

    def __call__(self, moe, x, experts):
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=moe.num_local).tolist()     # one host sync per layer
        xs = x.index_select(0, order)
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in zip(moe.local_experts(), counts):
            if n:
                ys[start:start + n] = expert(xs[start:start + n])
                start += n
        y = torch.empty_like(ys)
        y[order] = ys
        return y


class TritonGroupedGemm(MoEKernel):
    name = "triton"

    def prepare(self, moe) -> None:
        experts = moe.local_experts()
        for e in experts:
            for layer in (e.gate_up_proj, e.down_proj):
                if layer.weight is None or not layer.quant_method.is_float or layer.has_bias:
                    raise ValueError("the triton MoE kernel takes float expert weights without bias; "
                                     f"{layer.prefix or 'an expert layer'} uses {layer.quant_method.name}")
        moe.register_buffer("w13", torch.stack([e.gate_up_proj.weight.data for e in experts]), persistent=False)
        moe.register_buffer("w2", torch.stack([e.down_proj.weight.data for e in experts]), persistent=False)
        for e in experts:                          # the stacked copies are what is read from now on
            e.gate_up_proj.weight = None
            e.down_proj.weight = None
        self.act_and_mul = experts[0].act_and_mul

    def __call__(self, moe, x, experts):
        from tokenmill.layers.moe.triton_moe import grouped_matmul, sort_rows_by_expert
        layout = sort_rows_by_expert(experts, moe.num_local)
        h = grouped_matmul(x, moe.w13, layout)                        # [N, 2 * intermediate]
        return grouped_matmul(self.act_and_mul(h), moe.w2, layout)


MOE_KERNELS = {"grouped_linears": "tokenmill.layers.moe.kernels:GroupedLinears",     # name -> module:class
               "triton": "tokenmill.layers.moe.kernels:TritonGroupedGemm",
               "cpu_grouped": "tokenmill.platforms.cpu_moe:CPUGroupedGemm"}


def get_moe_kernel(name: str) -> MoEKernel:
    if name not in MOE_KERNELS:
        raise ValueError(f"unknown MoE kernel {name!r}; expected one of {sorted(MOE_KERNELS)}")
    import importlib
    module, cls = MOE_KERNELS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
