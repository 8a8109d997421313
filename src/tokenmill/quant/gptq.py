"""GPTQ (Frantar et al., 2022): rounding a linear layer's weight onto a format's grid one input column at a
time, each column's rounding error spread over the columns not yet rounded so that the layer's output on
the calibration inputs moves least. The quantity it keeps small is the output error on those inputs:

    || X W^T - X Q^T ||^2 = trace((W - Q) H (W - Q)^T),      H = X^T X / tokens   [K, K]

Plain rounding (RTN) minimizes each weight's own error and ignores H. Here the grid is any `round_to_grid`
(codes x a fixed scale per output row and input column, e.g. FP8 E4M3 per channel or per 128 x 128 block),
so the checkpoint's format and scales are exactly what RTN would write; only which grid point each weight
takes changes.

Steps (the paper's, in float64): dead inputs (H[k, k] = 0) are zeroed; H is damped by `damp` x its mean
diagonal; with `act_order` the columns go in order of decreasing H[k, k] (the most active inputs first,
while the most columns are left to absorb their error); U = the upper Cholesky factor of H^-1; the
columns go in blocks of `block`, errors propagated inside the block column by column and to the rest of
the matrix once per block (the same arithmetic, fewer passes over W)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# (weights [N, c] float32, scales [N, c] float32) -> the nearest grid values [N, c] float32 (codes x scales)
RoundToGrid = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GPTQConfig:
    damp: float = 0.01            # added to H's diagonal, as a fraction of its mean diagonal
    block: int = 128              # columns per lazy-update block
    act_order: bool = True        # columns in order of decreasing H[k, k]


def quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor,
                    round_to_grid: RoundToGrid, cfg: GPTQConfig = GPTQConfig()) -> torch.Tensor:
    """weight [N, K], hessian = X^T X / tokens [K, K] of the layer's inputs, scales [N, K] (each weight's
    scale, fixed beforehand) -> the rounded weight [N, K] float32, every value on round_to_grid's grid."""
    n, k = weight.shape
    if hessian.shape != (k, k) or scales.shape != (n, k):
        raise ValueError(f"GPTQ: weight {tuple(weight.shape)} needs hessian [{k}, {k}] and scales [{n}, {k}], "
                         f"got {tuple(hessian.shape)} and {tuple(scales.shape)}")
    w, h, s = weight.double().clone(), hessian.double().clone(), scales.float()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(h.diagonal(), descending=True) if cfg.act_order else torch.arange(k)
    w, h, s = w[:, order], h[order][:, order], s[:, order]
    h.diagonal().add_(cfg.damp * h.diagonal().mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w)
    for start in range(0, k, cfg.block):
        end = min(start + cfg.block, k)
        errors = _round_block(w[:, start:end], u[start:end, start:end], s[:, start:end], q[:, start:end],
                              round_to_grid)
        w[:, end:] -= errors @ u[start:end, end:]
    return q[:, torch.argsort(order)].float()


def _round_block(w: torch.Tensor, u: torch.Tensor, s: torch.Tensor, q_out: torch.Tensor,
                 round_to_grid: RoundToGrid) -> torch.Tensor:
    """Rounds the block's columns in order into q_out, updating w's later columns in place; returns the
    scaled errors [N, c] that the columns after the block take."""
    errors = torch.empty_like(w)
    for i in range(w.shape[1]):
        col = w[:, i:i + 1]
        q = round_to_grid(col.float(), s[:, i:i + 1]).double()
        q_out[:, i:i + 1] = q
        err = (col - q) / u[i, i]
        w[:, i:] -= err @ u[i:i + 1, i:]
        errors[:, i:i + 1] = err
    return errors


def output_error(weight: torch.Tensor, rounded: torch.Tensor, hessian: torch.Tensor) -> float:
    """trace((W - Q) H (W - Q)^T): the mean squared output error per token summed over outputs."""
    d = (weight - rounded).double()
    return float(((d @ hessian.double()) * d).sum())
