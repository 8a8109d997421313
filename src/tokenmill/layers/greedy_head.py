"""Greedy tokens from a float32 lm_head without its float32 logits (csrc/greedy_head.cpp).

A greedy row needs only the argmax of its logits. The native kernel screens the vocabulary with a
bfloat16 copy of the head (twice the float32 FMA rate on AVX-512 BF16, half the bytes), bounds the
screen's error rigorously (Cauchy-Schwarz on the weight rows' and the hidden state's norms), and rechecks
in double precision the few tokens the bound cannot rule out: the result is the argmax of the exact
logits, not an approximation. Default model, offline workload: 3 rechecks per row on average, a 64-row
head in 10.5 ms instead of 18 (see csrc/greedy_head.cpp, benchmarks/profile_step.py).

Only for a float32 head whose tile copy exists (UnquantizedMethod with the native tile kernels) on a CPU
with AVX-512 BF16; `GreedyHead.build` returns None otherwise and the caller computes logits as before.
"""
from __future__ import annotations

import torch

from tokenmill.layers import cpu_kernels


class GreedyHead:
    """hidden [R, K] float32 -> greedy token per row (argmax of hidden @ W.T with banned tokens excluded)."""

    def __init__(self, native, f32_tiles: torch.Tensor, vocab_size: int, norms: torch.Tensor) -> None:
        self.native, self.vocab_size, self.f32_tiles = native, vocab_size, f32_tiles
        self.bf16_tiles = bf16_tiles_from_f32_tiles(f32_tiles)                    # [ceil(N/16), K/2, 16, 2]
        self.norms = norms                                                         # [N] float32 upper bounds
        self.norm_max = float(norms.max())
        self._workspace = torch.empty(0)                                          # [R * N] float32, reused
        self.rows_screened = 0           # observability: rows answered, candidates rechecked in all
        self.candidates_checked = 0

    @staticmethod
    def build(lm_head) -> "GreedyHead | None":
        """For a float32 Linear with tiles (quant/unquantized.py) on an AVX-512 BF16 build, else None."""
        native = cpu_kernels.load()
        tiles = getattr(lm_head, "f32_tiles", None)
        if native is None or not hasattr(native, "greedy_head") or tiles is None or lm_head.bias is not None \
                or tiles.shape[1] % 2:
            return None
        n = lm_head.out_features
        norms = torch.linalg.vector_norm(tiles, dim=1, dtype=torch.float64).flatten()[:n]   # ||w_j||
        if not bool(torch.isfinite(norms).all()):        # a weight not finite (float32 squares cannot overflow
            return None                                   # a float64 sum)
        norms = norms.float()
        norms = torch.nextafter(norms, torch.full_like(norms, float("inf")))    # rounded up: upper bounds
        return GreedyHead(native, tiles, n, norms)

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
        tokens, counts = self.native.greedy_head(hidden, self.bf16_tiles, self.f32_tiles, self.norms,
                                                 self.norm_max, self.vocab_size, banned_ids, self._workspace)
        answered = tokens >= 0
        self.rows_screened += int(answered.sum())
        self.candidates_checked += int(counts.sum())
        return tokens


def bf16_tiles_from_f32_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """[ceil(N/16), K, 16] float32 tiles (quant/unquantized.py pack_f32_tiles) -> [ceil(N/16), K/2, 16, 2]
    bfloat16 (round to nearest even): input pair (2p, 2p+1) of 16 rows side by side, rows past N zero."""
    blocks, k, _ = tiles.shape
    return tiles.view(blocks, k // 2, 2, 16).transpose(2, 3).to(torch.bfloat16).contiguous()
