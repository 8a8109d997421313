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
import torch.nn.functional as F

from tokenmill.layers import cpu_kernels


class GreedyHead:
    """hidden [R, K] float32 -> greedy token per row (argmax of hidden @ W.T with banned tokens excluded)."""

    def __init__(self, native, weight: torch.Tensor, f32_tiles: torch.Tensor) -> None:
        n, k = weight.shape
        self.native, self.vocab_size, self.f32_tiles = native, n, f32_tiles
        self.bf16_tiles = pack_bf16_tiles(weight)                                 # [ceil(N/16), K/2, 16, 2]
        norms = weight.double().norm(dim=1).float()
        self.norms = torch.nextafter(norms, torch.full_like(norms, float("inf")))  # upper bounds, float32
        self._workspace = torch.empty(0)                                          # [R * N] float32, reused
        self.rows_screened = 0           # observability: rows answered, candidates rechecked in all
        self.candidates_checked = 0

    @staticmethod
    def build(lm_head) -> "GreedyHead | None":
        """For a float32 Linear with tiles (quant/unquantized.py) on an AVX-512 BF16 build, else None."""
        native = cpu_kernels.load()
        tiles = getattr(lm_head, "f32_tiles", None)
        if native is None or not hasattr(native, "greedy_head") or tiles is None or lm_head.bias is not None:
            return None
        weight = unpack_f32_tiles(tiles, lm_head.out_features)
        if weight.shape[1] % 2 or not bool(torch.isfinite(weight).all()):
            return None
        return GreedyHead(native, weight, tiles)

    def __call__(self, hidden: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
        """hidden [R, K] float32, banned: per row the token ids to exclude (min_tokens masking). Returns
        [R] int64; -1 where the row has no screened answer (non-finite hidden state, everything banned):
        the caller computes that row's logits instead."""
        rows = hidden.shape[0]
        if self._workspace.numel() < rows * self.vocab_size:
            self._workspace = torch.empty(rows * self.vocab_size)
        width = max((len(b) for b in banned), default=0)
        banned_ids = torch.full((rows, width), -1, dtype=torch.long)
        for i, ids in enumerate(banned):
            banned_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        tokens, counts = self.native.greedy_head(hidden, self.bf16_tiles, self.f32_tiles, self.norms,
                                                 self.vocab_size, banned_ids, self._workspace)
        answered = tokens >= 0
        self.rows_screened += int(answered.sum())
        self.candidates_checked += int(counts.sum())
        return tokens


def pack_bf16_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 -> [ceil(N/16), K/2, 16, 2] bfloat16 (round to nearest even): input pair (2p, 2p+1)
    of 16 rows side by side, rows past N zero."""
    n, k = w.shape
    blocks = (n + 15) // 16
    w = F.pad(w, (0, 0, 0, blocks * 16 - n)).to(torch.bfloat16)
    return w.view(blocks, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_f32_tiles(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """[ceil(N/16), K, 16] (pack_f32_tiles) -> the weight [N, K] float32."""
    blocks, k, _ = tiles.shape
    return tiles.transpose(1, 2).reshape(blocks * 16, k)[:n]
