"""float32 weights (exact checkpoint values), on the fastest CPU GEMM path per shape:

- several rows (prefill chunks, decode batches): oneDNN's linear over a weight reordered once into its
  blocked layout (`mkldnn._reorder_linear_weight`, the path torch.compile's CPU freezing uses). Measured on
  the project's CPU it runs at 100-112 GFLOP/s per core where F.linear gives 40-95 (60 for the 49152-wide
  lm_head), see benchmarks/profile_step.py;
- a single row (batch-1 decode): the weight's rows split into one batched GEMV per thread. For x [1, K]
  F.linear runs one single-threaded GEMV streaming the weight at about 12 GB/s; `bmm` over `num_threads`
  row blocks runs them in parallel at about 35-40 GB/s (benchmarks/decode_latency.py measures it).
Same math in float32 throughout (only the summation order differs from F.linear).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.base import QuantMethod

_HAS_ONEDNN = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


class UnquantizedMethod(QuantMethod):
    name = "fp32"

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.add_bias(layer, gemv_split_rows(layer.weight, x))
        packed = onednn_weight(layer) if x.dtype == torch.float32 and not x.is_cuda else None
        if packed is None:
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")


def onednn_weight(layer) -> torch.Tensor | None:
    """The layer's weight reordered for oneDNN, made on first use and kept on the layer (weights never
    change after loading). None where oneDNN is unavailable or the weight is not float32 on the CPU."""
    packed = getattr(layer, "_onednn_weight", None)
    if packed is None and _HAS_ONEDNN and layer.weight.dtype == torch.float32 and not layer.weight.is_cuda:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        layer._onednn_weight = packed
    return packed


def gemv_split_rows(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weight [N, K], x [1, K] -> x @ weight.T [1, N], as `bmm` over row blocks of weight."""
    num_blocks = torch.get_num_threads()
    n, k = weight.shape
    if num_blocks < 2 or n % num_blocks:
        return F.linear(x, weight)
    w = weight.view(num_blocks, n // num_blocks, k)                     # [P, N/P, K]
    y = torch.bmm(w, x.t().expand(num_blocks, k, 1))                    # [P, N/P, 1]
    return y.view(1, n)
