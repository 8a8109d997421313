"""MoE MLPs: routed gated-MLP experts (plus DeepSeek's shared experts) behind a router; the activation is
the config's hidden_act (SwiGLU by default, layers/activation.py) or gpt-oss's clamped SwiGLU.

    SparseMoeBlock(x [T, hidden]) = sum over the token's k experts of w_e * expert_e(x) (+ shared(x))

Tokens are grouped by expert so each expert's weights are read once per step (kernels.py: a grouped GEMM
over the sorted tokens). Each expert is a pair of layers/linear.py Linears, so every quantization method
that applies to linears applies to experts, on every platform.

Across the tensor-parallel ranks, MoE layers run in one of two ways (distributed/parallel_state.py):
- split experts (default): every rank holds every expert's run of intermediate columns; the partial sums
  are all-reduced once per layer (routed and shared experts together);
- expert parallel (enable_expert_parallel): rank r holds whole experts split_evenly(E, ranks, r); each
  rank takes a run of the step's tokens (every rank has them all after attention), sends each (token,
  expert) pair to the expert's rank and gets the result back (all_to_all_single both ways), and the
  ranks' token runs are all-gathered.
Routing runs on every rank for every token (it is cheap), so every rank counts every expert's tokens.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tokenmill.config import MoEConfig
from tokenmill.distributed.communication import all_gather_rows, all_reduce, all_to_all_rows, exchange_counts
from tokenmill.distributed.parallel_state import expert_parallel, split_evenly, tensor_parallel
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.linear import MergedLinear, RowParallelLinear
from tokenmill.layers.moe.kernels import GroupedLinears, MoEKernel, get_moe_kernel
from tokenmill.layers.moe.router import Router


class Expert(nn.Module):
    """One gated MLP, x [N, hidden] -> [N, hidden]: down(act(gate_up(x))), act `moe.activation` (the config's
    hidden_act, SiLU by default, or gpt-oss's clamped SwiGLU), biases where `moe.expert_bias`. `split`: this
    tensor-parallel rank holds a run of the intermediate columns and returns a partial sum (the caller
    reduces); else it is whole."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, split: bool,
                 moe: MoEConfig | None = None) -> None:
        super().__init__()
        tp = tensor_parallel()
        run = split_evenly(intermediate, tp.size, tp.rank) if split else (0, intermediate)
        bias = bool(moe and moe.expert_bias)
        self.gate_up_proj = MergedLinear(hidden, {"gate": intermediate, "up": intermediate}, bias=bias, dtype=dtype,
                                         shard_runs={"gate": run, "up": run})
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, dtype=dtype, cols=run)
        self.down_proj.reduce = False                       # the MoE block reduces once for all experts
        # act(gate) * up over [N, 2I] -> [N, I] (the MoE kernels apply it between their two grouped GEMMs)
        self.act_and_mul = expert_activation(moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


def expert_activation(moe: MoEConfig | None):
    """The experts' act_and_mul: gpt-oss's clamped SwiGLU, else the gated `moe.activation` (SiLU without moe)."""
    if moe is not None and moe.activation == "clamped_swiglu":
        return partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
    return gated_activation("silu" if moe is None else moe.activation)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: [T, 2I] as [gate | up] -> [T, I] = (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g),
    g = gate clamped above at limit."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


class FusedMoE(nn.Module):
    """This rank's routed experts, as children named by their global index ("0", "1", ...), so checkpoint
    names (`...experts.{e}.gate_proj.weight`) address them directly."""

    def __init__(self, hidden: int, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        ep = expert_parallel()
        self.num_experts, self.hidden = moe.num_experts, hidden
        self.first_expert, self.num_local = split_evenly(moe.num_experts, ep.size, ep.rank)
        for e in range(self.first_expert, self.first_expert + self.num_local):
            self.add_module(str(e), Expert(hidden, moe.expert_intermediate_size, dtype, split=ep.size == 1, moe=moe))
        self.kernel: MoEKernel = GroupedLinears()
        # tokens routed to each expert (all experts, every rank), cumulative: the load-balance metric
        self.register_buffer("routed_tokens", torch.zeros(moe.num_experts, dtype=torch.long), persistent=False)

    def local_experts(self) -> list[Expert]:
        return [getattr(self, str(e)) for e in range(self.first_expert, self.first_expert + self.num_local)]

    def owns(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_local

    def set_kernel(self, name: str) -> None:
        """Switch to kernels.py's `name` (after loading and quantization: it may repack the weights)."""
        kernel = get_moe_kernel(name)
        kernel.prepare(self)
        self.kernel = kernel

    def count(self, ids: torch.Tensor) -> None:
        self.routed_tokens += torch.bincount(ids.flatten(), minlength=self.num_experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights/ids [T, k] (every expert local) -> sum_k w * expert(x) [T, hidden]."""
        k = ids.shape[1]
        y = self.kernel(self, x.repeat_interleave(k, dim=0) if k > 1 else x, ids.flatten() - self.first_expert)
        return _weighted_sum(y, weights, x.shape[0])

    def forward_expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T_r, hidden]: this rank's run of tokens; their pairs go to the experts' ranks and back."""
        ep = expert_parallel()
        flat = ids.flatten()                                           # [T_r * k], token-major
        owner = _owner_rank(flat, self.num_experts, ep.size)
        order = torch.argsort(owner, stable=True)                      # grouped by destination rank
        send_counts = torch.bincount(owner, minlength=ep.size).tolist()
        k = ids.shape[1]
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        recv_counts = exchange_counts(send_counts, ep.group, x.device)
        received = all_to_all_rows(rows, send_counts, recv_counts, ep.group)            # dispatch
        experts = all_to_all_rows(flat[order], send_counts, recv_counts, ep.group) - self.first_expert
        out = self.kernel(self, received, experts)
        back = all_to_all_rows(out, recv_counts, send_counts, ep.group)                 # combine
        y = torch.empty_like(back)
        y[order] = back                                                # token-major again
        return _weighted_sum(y, weights, x.shape[0])


def _weighted_sum(y: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """y [T * k, hidden] (token-major) -> [T, hidden]: each token's k rows weighted and summed."""
    k = weights.shape[1]
    return (y.view(num_tokens, k, y.shape[-1]) * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)


def _owner_rank(experts: torch.Tensor, num_experts: int, ranks: int) -> torch.Tensor:
    """The rank that holds each expert under split_evenly(num_experts, ranks, r)."""
    base, extra = divmod(num_experts, ranks)
    long_part = extra * (base + 1)                    # the first `extra` ranks hold base + 1 experts
    return torch.where(experts < long_part, torch.div(experts, base + 1, rounding_mode="floor"),
                       extra + torch.div(experts - long_part, max(base, 1), rounding_mode="floor"))


class SparseMoeBlock(nn.Module):
    """The MoE MLP of a layer: router (`gate`), routed experts (`experts`) and, for DeepSeek, the shared
    experts (`shared_experts`); x [T, hidden] -> [T, hidden], whole on every rank."""

    def __init__(self, hidden: int, moe: MoEConfig, dtype: torch.dtype) -> None:
        super().__init__()
        ep = expert_parallel()
        self.gate = Router(hidden, moe)
        self.experts = FusedMoE(hidden, moe, dtype)
        # DeepSeek's shared experts: the routed ones' activation (the config's hidden_act) and biases (none)
        self.shared_experts = (Expert(hidden, moe.num_shared_experts * moe.expert_intermediate_size, dtype,
                                      split=ep.size == 1, moe=moe) if moe.num_shared_experts else None)
        self.expert_parallel = ep.size > 1
        self.reduce = tensor_parallel().size > 1 and not self.expert_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        self.experts.count(ids)
        if self.expert_parallel:
            return self._forward_expert_parallel(x, weights, ids)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return all_reduce(out) if self.reduce else out

    def _forward_expert_parallel(self, x, weights, ids) -> torch.Tensor:
        ep = expert_parallel()
        sizes = [split_evenly(x.shape[0], ep.size, r)[1] for r in range(ep.size)]
        first = sum(sizes[:ep.rank])
        mine = slice(first, first + sizes[ep.rank])
        out = self.experts.forward_expert_parallel(x[mine], weights[mine], ids[mine])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x[mine])
        return all_gather_rows(out, sizes, ep.group)


def moe_blocks(model: nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def expert_token_counts(model: nn.Module) -> list[int] | None:
    """Tokens routed to each expert index, summed over the MoE layers since start; None without MoE."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    return torch.stack([b.routed_tokens for b in blocks]).sum(dim=0).tolist()
