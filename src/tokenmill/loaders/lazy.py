"""Checkpoint tensors read in part: a tensor-parallel rank asks for its (rows, cols) of each tensor, and
only those are read (safetensors: a slice of the mapped file) or dequantized (GGUF: the rows, and whole
blocks of the columns). A plain torch.Tensor is a checkpoint tensor too (sliced in memory).

    read_part(value, rows, cols) -> torch.Tensor      # rows, cols: slices of the HF-shaped tensor
"""
from __future__ import annotations

import torch


def read_part(value, rows: slice, cols: slice) -> torch.Tensor:
    """Rows `rows` (and, for 2-D tensors, columns `cols`) of a checkpoint tensor, as a torch tensor."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.dim() == 1 else value[rows, cols]
    return value.read(rows, cols)


class SafetensorsSlice:
    """A tensor of an open safetensors file (valid while the file is open: the loader reads it before
    asking for the next)."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, rows: slice, cols: slice) -> torch.Tensor:
        if len(self.shape) == 0:                  # a scalar (e.g. a per-tensor FP8 scale): whole
            return self._slice[...]
        if len(self.shape) == 1:
            return self._slice[rows]
        return self._slice[rows, cols]


class GGUFTensor:
    """A GGUF tensor's raw blocks [*rows, row_bytes] (a view of the mapped file), dequantized on read. Q/K
    rows are un-permuted to HF order first when `n_head` says so."""

    def __init__(self, raw, ggml_type: int, shape: tuple[int, ...], n_head: int) -> None:
        self.raw, self.ggml_type, self.shape, self.n_head = raw, ggml_type, tuple(shape), n_head

    def read(self, rows: slice, cols: slice) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES
        from tokenmill.loaders.gguf import unpermute_rows
        from tokenmill.loaders.gguf_dequant import dequantize
        if len(self.shape) == 1:                              # norms, biases: small, whole
            t = dequantize(self.raw, self.ggml_type, self.shape)
            return (unpermute_rows(t, self.n_head) if self.n_head else t)[rows]
        raw = unpermute_rows(self.raw, self.n_head) if self.n_head else self.raw
        raw = raw[rows]
        n, k = raw.shape[0], self.shape[1]
        start, stop, _ = cols.indices(k)
        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        if (start, stop) == (0, k):
            return dequantize(raw, self.ggml_type, (n, k))
        if start % block == 0 and stop % block == 0:          # whole blocks: dequantize only those
            part = raw[:, start // block * block_bytes: stop // block * block_bytes]
            return dequantize(part, self.ggml_type, (n, stop - start))
        return dequantize(raw, self.ggml_type, (n, k))[:, start:stop]
