"""Greedy tokens from a float32 lm_head without its float32 logits (csrc/greedy_head.cpp).

A greedy row needs only the argmax of its logits. The native kernel screens the vocabulary with an int8
copy of the head (AVX-512 VNNI: four times the float32 FMA rate, a quarter of the bytes) against each row's
hidden state quantized to int8, except the step's few largest hidden dimensions, which it takes in float32
(the default model's hidden states have a few dimensions tens of times larger than the rest). It bounds the
screen's error rigorously (the quantization errors' norms, Cauchy-Schwarz) and rechecks in double
precision the few tokens the bound cannot rule out: the result is the argmax of the exact logits, not an
approximation (see csrc/greedy_head.cpp for the bound, benchmarks/profile_step.py for the counts).

Only for a float32 head whose tile copy exists (UnquantizedMethod with the native tile kernels) on a CPU
with AVX-512 VNNI; `GreedyHead.build` returns None otherwise and the caller computes logits as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.platforms import cpu_native


class GreedyHead:
    """hidden [R, K] float32 -> greedy token per row (argmax of hidden @ W.T with banned tokens excluded)."""

    def __init__(self, native, f32_tiles: torch.Tensor, vocab_size: int, screen: "Int8Screen") -> None:
        self.native, self.vocab_size, self.f32_tiles, self.screen = native, vocab_size, f32_tiles, screen
        self.norm_max = float(screen.norms.max())
        self._workspace = torch.empty(0)                                          # [R * N] float32, reused
        self.rows_screened = 0           # observability: rows answered, candidates rechecked in all
        self.candidates_checked = 0

    @staticmethod
    def build(lm_head) -> "GreedyHead | None":
        """For a float32 Linear with tiles (quant/unquantized.py) on an AVX-512 VNNI build, else None."""
        native = cpu_native.load()
        tiles = getattr(lm_head, "f32_tiles", None)
        if native is None or not hasattr(native, "greedy_head") or tiles is None or lm_head.bias is not None \
                or tiles.shape[1] > 65536:                # int32 dot products
            return None
        screen = Int8Screen.from_f32_tiles(tiles, lm_head.out_features)
        return None if screen is None else GreedyHead(native, tiles, lm_head.out_features, screen)

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
        """hidden [R, K] float32, banned: per row the token ids to exclude (min_tokens masking). Returns
        [R] int64; -1 where the row has no screened answer (non-finite hidden state, everything banned):
        the caller computes that row's logits instead."""
        rows = hidden.shape[0]
        if self._workspace.numel() < rows * self.vocab_size:
            self._workspace = torch.empty(rows * self.vocab_size)
        width = max((len(b) for b in banned), default=0)
        banned_ids = torch.tensor([list(ids) + [-1] * (width - len(ids)) for ids in banned],  # [R, width]
                                  dtype=torch.long).view(rows, width)                     # -1: padding
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        sc = self.screen
        tokens, counts = self.native.greedy_head(hidden, sc.tiles, sc.scales, sc.qsums, self.f32_tiles, sc.norms,
                                                 sc.err_norms, self.norm_max, self.vocab_size, banned_ids,
                                                 self._workspace)
        answered = tokens >= 0
        self.rows_screened += int(answered.sum())
        self.candidates_checked += int(counts.sum())
        return tokens


@dataclass(frozen=True)
class Int8Screen:
    """The head's int8 copy for the screen: w_j = scales[j] q_j + e_j, q_j = round(w_j / scales[j]) in
    [-127, 127], scales[j] = max |w_j| / 127 (1 for a zero row)."""
    tiles: torch.Tensor        # [ceil(N/16), ceil(K/4), 64] int8: byte 4i + c of quad g = row i's input 4g + c
    scales: torch.Tensor       # [ceil(N/16) * 16] float32, zero past N
    qsums: torch.Tensor        # [ceil(N/16) * 16] int32: sum_k q_jk, zero past N
    norms: torch.Tensor        # [N] float32: upper bounds of ||w_j||
    err_norms: torch.Tensor    # [N] float32: upper bounds of ||e_j||

    @staticmethod
    def from_f32_tiles(f32_tiles: torch.Tensor, n: int, rows_per_pass: int = 4096) -> "Int8Screen | None":
        """From gemv_f32's [ceil(N/16), K, 16] tiles; None if a weight is not finite. Rows are quantized a
        few thousand at a time (float64 temporaries stay small)."""
        blocks, k, _ = f32_tiles.shape
        k4 = -(-k // 4)
        weight = f32_tiles.transpose(1, 2).reshape(blocks * 16, k)          # [blocks * 16, K], rows past N zero
        q = torch.zeros(blocks * 16, 4 * k4, dtype=torch.int8)
        scales = torch.zeros(blocks * 16)
        norms, err_norms = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        for r0 in range(0, n, rows_per_pass):
            w = weight[r0:min(n, r0 + rows_per_pass)].double()
            if not bool(torch.isfinite(w).all()):
                return None
            s = (w.abs().amax(dim=1) / 127).float().double()
            s[s == 0] = 1.0
            qs = torch.round(w / s[:, None]).clamp_(-127, 127)
            q[r0:r0 + len(w), :k] = qs.to(torch.int8)
            scales[r0:r0 + len(w)] = s.float()
            norms[r0:r0 + len(w)] = torch.linalg.vector_norm(w, dim=1)
            err_norms[r0:r0 + len(w)] = torch.linalg.vector_norm(w - s[:, None] * qs, dim=1)   # exact in float64
        tiles = q.view(blocks, 16, k4, 4).permute(0, 2, 1, 3).reshape(blocks, k4, 64).contiguous()
        return Int8Screen(tiles, scales, q.sum(dim=1, dtype=torch.int32), _rounded_up(norms), _rounded_up(err_norms))


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 upper bounds: rounding to nearest loses at most half an ulp, one ulp up covers it."""
    out = values.float()
    return torch.nextafter(out, torch.full_like(out, float("inf")))
