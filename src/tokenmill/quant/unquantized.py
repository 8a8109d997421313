"""float32 weights: F.linear, except for a single row (batch-1 decode), where it splits the weight's
rows into one batched GEMV per thread.

Why: for x [1, K] PyTorch's F.linear runs one single-threaded GEMV that streams the weight at about
12 GB/s on the project's CPU; `bmm` over `num_threads` row blocks runs them in parallel and reaches
about 35-40 GB/s (benchmarks/decode_latency.py measures it). Same math, float32 throughout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.base import QuantMethod


class UnquantizedMethod(QuantMethod):
    name = "fp32"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1:
            return F.linear(x, layer.weight, layer.bias)
        return self.add_bias(layer, gemv_split_rows(layer.weight, x))


def gemv_split_rows(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K], x [1, K] -> x @ weight.T [1, N], as `bmm` over row blocks of weight."""
    num_blocks = torch.get_num_threads()
    n, k = weight.shape
    if num_blocks < 2 or n % num_blocks:
        return F.linear(x, weight)
    w = weight.view(num_blocks, n // num_blocks, k)                     # [P, N/P, K]
    y = torch.bmm(w, x.t().expand(num_blocks, k, 1))                    # [P, N/P, 1]
    return y.view(1, n)
