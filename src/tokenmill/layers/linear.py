"""Linear layers with checkpoint-aware loading. Fused projections (qkv, gate_up) are one weight whose
row ranges are filled from several checkpoint tensors, named by shard id."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_rows(self, shard_id) -> slice:
        """Rows of the weight that checkpoint shard `shard_id` fills; the whole weight by default."""
        return slice(0, self.out_features)


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
