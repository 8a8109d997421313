"""Choosing each token's experts: softmax top-k (Mixtral, Qwen3-MoE; gpt-oss's logits carry a bias) or
DeepSeek-V3's sigmoid scores with a correction bias and grouped top-k. The gate is a float32 matrix in every dtype (routing decides which
weights a token reads; DeepSeek keeps it float32 too) and is never quantized."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import MoEConfig


class Router(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.cfg = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size), requires_grad=False)
        if moe.correction_bias:          # checkpoint name: e_score_correction_bias
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False) if moe.router_bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
        logits = F.linear(x.float(), self.weight, self.bias)                       # [T, E] float32
        if self.cfg.scoring == "softmax":
            return softmax_top_k(logits, self.cfg)
        return grouped_sigmoid_top_k(logits, self.e_score_correction_bias if self.cfg.correction_bias else None,
                                     self.cfg)


def softmax_top_k(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = logits.softmax(dim=-1).topk(moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_top_k(logits: torch.Tensor, bias: torch.Tensor | None,
                          moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ("noaux_tc"): scores = sigmoid(logits); the choice uses scores + bias, restricted to the
    topk_group groups whose two best biased scores sum highest; the weights are the unbiased scores of the
    chosen experts (renormalized), times routed_scaling_factor."""
    scores = logits.sigmoid()                                                      # [T, E]
    choice = scores if bias is None else scores + bias
    if moe.num_groups > 1:
        grouped = choice.view(choice.shape[0], moe.num_groups, -1)                 # [T, G, E / G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)   # [T, G]
        chosen_groups = group_scores.topk(moe.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids
