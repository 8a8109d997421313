"""Linear layers with checkpoint-aware loading. Fused projections (qkv, gate_up) are one weight whose
row ranges are filled from several checkpoint tensors, named by shard id.

Tensor parallelism (distributed/parallel_state.py gives the rank when the layer is built): a
ColumnParallelLinear holds a run of the output rows (its output is this rank's slice), a
RowParallelLinear a run of the input columns (its partial outputs are summed over ranks: one all-reduce).
`checkpoint_slice(shard_id)` says which (rows, cols) of a checkpoint tensor this rank's parameter holds,
so loaders read only that. In a group of one every layer is whole.

The arithmetic is delegated to a quantization method object (tokenmill.quant): F.linear as loaded;
`set_quant_method` switches a loaded layer to its platform's method (float or quantized), which packs the
weight for its kernel (layers/quantize.py does it for a whole model)."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.distributed.communication import all_reduce
from tokenmill.distributed.parallel_state import split_evenly, tensor_parallel
from tokenmill.quant.base import LoadedFloatMethod, QuantMethod

_AS_LOADED = LoadedFloatMethod()


@dataclass(frozen=True)
class PrefillRows:
    """Which rows of the running step are prefill rows (prompt chunks, recomputed tokens): the rest are decode
    and verify rows. Layers whose method has a prefill kernel run these rows through it (QuantMethod.
    prefill_kernel) when there are at least its prefill_rows_from() of them."""
    step_rows: int                 # T, the step's rows; a layer given fewer (the last layer's kept rows) runs
                                   # them all as decode rows
    index: torch.Tensor | None     # [P] int64, ascending, the prefill rows; None: every row is one
    others: torch.Tensor | None    # [T - P] int64, ascending, the rest; None when index is None

    @property
    def count(self) -> int:
        return self.step_rows if self.index is None else self.index.numel()

    @classmethod
    def of(cls, step_rows: int, index: list[int]) -> "PrefillRows | None":
        """From the prefill rows' indices (ascending); None when there are none."""
        if not index:
            return None
        if len(index) == step_rows:
            return cls(step_rows, None, None)
        taken = torch.zeros(step_rows, dtype=torch.bool)
        rows = torch.tensor(index, dtype=torch.long)
        taken[rows] = True
        return cls(step_rows, rows, (~taken).nonzero().view(-1))


_STEP_PREFILL_ROWS: contextvars.ContextVar = contextvars.ContextVar("tokenmill_prefill_rows", default=None)


@contextlib.contextmanager
def step_prefill_rows(rows: PrefillRows | None):
    """The running step's prefill rows for every Linear.forward inside (the model runner sets it around
    the model's forward; None: none, every row runs as a decode row)."""
    token = _STEP_PREFILL_ROWS.set(rows)
    try:
        yield
    finally:
        _STEP_PREFILL_ROWS.reset(token)


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out_features, in_features] (until a quantization method packs it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.has_bias, self.params_dtype = bias, dtype
        self.prefix = ""                              # module name, for error messages
        self.quant_method: QuantMethod = _AS_LOADED
        self.quant_method.create_weights(self)
        self.tile_fn = None                           # x -> y for steps of <= tile_max_rows rows
        self.tile_max_rows = 0
        self.prefill_fn = None                        # x -> y for a step's prefill rows (PrefillRows), when
        self.prefill_min_rows = 0                     # it has at least this many of them
        # x -> x rounded as a pre-quantized checkpoint quantizes this layer's input (quant/activations.py),
        # applied before the method; None: the input goes in as it is
        self.input_quant = None

    def set_quant_method(self, method: QuantMethod) -> None:
        """After loading: pack the float weight for `method` and use it from now on."""
        method.process_weights_after_loading(self)
        self.quant_method = method
        self.tile_fn = method.tile_kernel(self)
        self.tile_max_rows = method.tile_max_rows
        self.prefill_fn = method.prefill_kernel(self) if self.tile_fn is not None else None
        self.prefill_min_rows = method.prefill_rows_from()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]."""
        if self.input_quant is not None:
            x = self.input_quant(x)
        if self.prefill_fn is not None:
            rows = _STEP_PREFILL_ROWS.get()
            if rows is not None and rows.step_rows == x.shape[0] and rows.count >= self.prefill_min_rows:
                return self._split_rows(x, rows)
        return self._decode_rows(x)

    def _decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_fn is not None and x.shape[0] <= self.tile_max_rows:
            return self.tile_fn(x)
        return self.quant_method.apply(self, x)

    def _split_rows(self, x: torch.Tensor, rows: PrefillRows) -> torch.Tensor:
        """The prefill rows through prefill_fn, the others as any step's rows."""
        if rows.index is None:
            return self.prefill_fn(x)
        y = x.new_empty(x.shape[0], self.out_features)
        y.index_copy_(0, rows.index, self.prefill_fn(x.index_select(0, rows.index)))
        y.index_copy_(0, rows.others, self._decode_rows(x.index_select(0, rows.others)))
        return y

    def shard_rows(self, shard_id) -> slice:
        """Rows of the weight that checkpoint shard `shard_id` fills; the whole weight by default."""
        return slice(0, self.out_features)

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        """(rows, cols) of checkpoint tensor `shard_id` that this rank holds; all of it by default. A bias
        takes the rows."""
        return slice(None), slice(None)

    def native_decode_linear(self, native):
        """This layer as csrc/decode_layer.cpp's DecodeLinear: the tile kernel its steps of up to
        tile_max_rows rows run and, where the method names one, the kernel `apply` runs for larger steps.
        None without a tile kernel (e.g. w8a8, or float32-compute reference modes), and where the input is
        rounded first (input_quant: the native layer would skip it)."""
        if self.input_quant is not None:
            return None
        tiles = self.quant_method.tile_weights(self) if self.tile_fn is not None else None
        if tiles is None:
            return None
        kind, weight, scales = tiles
        bias = None if self.bias is None else self.bias.data
        large = self.quant_method.large_kernel(self)
        # kind "" = no kernel above tile_max_rows (its weight argument is unused)
        large = native.LargeLinear("", weight) if large is None else native.LargeLinear(*large)
        return native.DecodeLinear(kind, weight, scales, bias, self.out_features, self.tile_max_rows,
                                   large, self.quant_method.tile_scale_block(self))


class ColumnParallelLinear(Linear):
    """This rank's run of the output rows: `rows` = (first, count) of the out_total (default: an even
    split over the group). Its output is the local slice; nothing is communicated."""

    def __init__(self, in_features: int, out_total: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 rows: tuple[int, int] | None = None) -> None:
        tp = tensor_parallel()
        self.rows = rows if rows is not None else split_evenly(out_total, tp.size, tp.rank)
        super().__init__(in_features, self.rows[1], bias, dtype)
        self.out_total = out_total

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        first, count = self.rows
        return slice(first, first + count), slice(None)


class RowParallelLinear(Linear):
    """This rank's run of the input columns: `cols` = (first, count) of in_total (default: an even split).
    forward(x [T, count]) -> the sum over ranks of x W_local^T: [T, out_features] on every rank.

    A bias is added once to the sum: by the rank whose run starts at column 0 (`adds_bias`; every rank when
    the layer is not split, as an expert-parallel rank's whole experts). The other ranks load the bias too,
    so every checkpoint tensor lands somewhere, and zero it when packed."""

    def __init__(self, in_total: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.float32,
                 cols: tuple[int, int] | None = None) -> None:
        tp = tensor_parallel()
        self.cols = cols if cols is not None else split_evenly(in_total, tp.size, tp.rank)
        super().__init__(self.cols[1], out_features, bias, dtype)
        self.in_total = in_total
        self.reduce = tp.size > 1
        self.adds_bias = self.cols[0] == 0

    def set_quant_method(self, method: QuantMethod) -> None:
        if self.bias is not None and not self.adds_bias:
            self.bias.data.zero_()              # the sum over ranks takes the bias from the rank that adds it
        super().set_quant_method(method)

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        first, count = self.cols
        return slice(None), slice(first, first + count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_reduce(y) if self.reduce else y


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output: e.g. q|k|v or gate|up. Across
    ranks each projection is column-parallel on its own: shard_rows[name] = (first, count) of that
    projection's checkpoint rows held here (default: an even split of each)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, shard_runs: dict[str, tuple[int, int]] | None = None) -> None:
        tp = tensor_parallel()
        runs = shard_runs or {name: split_evenly(size, tp.size, tp.rank) for name, size in shard_sizes.items()}
        super().__init__(in_features, sum(count for _, count in runs.values()), bias, dtype)
        self.shard_runs = runs
        self.shard_sizes = {name: runs[name][1] for name in shard_sizes}        # local sizes, in order
        offsets, start = {}, 0
        for name, size in self.shard_sizes.items():
            offsets[name] = slice(start, start + size)
            start += size
        self.offsets = offsets

    def shard_rows(self, shard_id) -> slice:
        return self.offsets[shard_id]

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        first, count = self.shard_runs[shard_id]
        return slice(first, first + count), slice(None)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """y [..., out_features] -> the per-shard views, in declaration order."""
        return list(y.split(list(self.shard_sizes.values()), dim=-1))
