"""float32 weights (exact checkpoint values), on the fastest CPU GEMM path per shape:

- more than tile_kernels.FLOAT32_MAX_ROWS rows (prefill chunks): oneDNN's linear over a weight reordered
  once into its blocked layout (`mkldnn._reorder_linear_weight`, the path torch.compile's CPU freezing
  uses). Measured on the project's CPU it runs at 100-112 GFLOP/s per core where F.linear gives 40-95 (60
  for the 49152-wide lm_head), see benchmarks/profile_step.py;
- up to FLOAT32_MAX_ROWS rows (decode steps): the native tile kernel (csrc/gemv_kernels.cpp gemv_f32) over
  a copy of the weight in tiles of 16 rows side by side (one FMA per 16 weights, no horizontal sums). At
  batch 1 it streams the weight at 48 GB/s where `bmm` over per-thread row blocks reads at 39 GB/s and a
  single-threaded F.linear GEMV at about 12; at 32-64 rows it runs the attention and MLP projections at
  215-231 GFLOP/s against oneDNN's 171-226 (best of 5, same process). Without the native kernels a single
  row takes the `bmm` split (gemv_split_rows).
Same math in float32 throughout (only the summation order differs from F.linear). With both the oneDNN copy
and the tiles made, the layer's own float32 weight is dropped (a tied embedding keeps its tensor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant import tile_kernels
from tokenmill.quant.base import QuantMethod

_HAS_ONEDNN = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()


class UnquantizedMethod(QuantMethod):
    name = "fp32"
    is_float = True
    tile_max_rows = tile_kernels.FLOAT32_MAX_ROWS

    def process_weights_after_loading(self, layer) -> None:
        if layer.weight is None or layer.weight.dtype != torch.float32 or layer.weight.is_cuda:
            return
        packed = onednn_weight(layer)                      # made now, not during the first request
        if tile_kernels.kernels() is not None:
            layer.register_buffer("f32_tiles", pack_f32_tiles(layer.weight.data), persistent=False)
            if packed is not None:
                self.drop_float_weight(layer)

    def tile_weights(self, layer):
        tiles = getattr(layer, "f32_tiles", None)
        return None if tiles is None else ("f32", tiles, None)

    def large_kernel(self, layer):
        packed = getattr(layer, "_onednn_weight", None)
        return None if packed is None else ("onednn", packed)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and layer.weight is not None:
            return self.add_bias(layer, gemv_split_rows(layer.weight, x))
        packed = onednn_weight(layer) if x.dtype == torch.float32 and not x.is_cuda else None
        if packed is None:
            return F.linear(x, layer.weight, layer.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")


def pack_f32_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [ceil(N/16), K, 16] float32: each input's weights for 16 rows side by side, rows past N
    zero (csrc/gemv_kernels.cpp gemv_f32)."""
    n, k = w.shape
    blocks = (n + 15) // 16
    w = F.pad(w.float(), (0, 0, 0, blocks * 16 - n))
    return w.view(blocks, 16, k).transpose(1, 2).contiguous()


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
