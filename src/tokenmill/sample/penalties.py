"""Logit processing that depends on a request's token history: penalties and min_tokens masking.

Both work in place on a [num_rows, vocab] float32 tensor that the caller owns (a clone, never the model's
logits). Per-row Python work is limited to building one flat (row, token) index per step; the tensor
updates are one gather/scatter per penalty kind for the whole batch.

Semantics (vLLM / OpenAI):
- repetition penalty r, over prompt + output tokens: a seen token's logit is divided by r when positive,
  multiplied by r otherwise (so r > 1 always makes it less likely);
- frequency f and presence p, over output tokens only: logit -= f * count + p * (count > 0);
- min_tokens: while fewer than min_tokens tokens were generated, EOS and stop_token_ids get -inf.
Repetition is applied first, then frequency and presence, then min_tokens masking.
"""
from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from tokenmill.sample.sampler import SamplingMeta


def needs_penalties(meta: "SamplingMeta") -> bool:
    return meta.params.has_penalties


def needs_min_tokens_mask(meta: "SamplingMeta") -> bool:
    """True while EOS / stop tokens must be masked for this row (and there is something to mask)."""
    params = meta.params
    return (len(meta.output_token_ids) < params.min_tokens
            and (len(meta.eos_token_ids) > 0 or len(params.stop_token_ids) > 0))


def apply_penalties(logits: torch.Tensor, metas: Sequence["SamplingMeta"]) -> None:
    """Apply repetition, then frequency + presence penalties, in place. logits: [num_rows, vocab]."""
    rep_rows = [i for i, m in enumerate(metas) if m.params.repetition_penalty != 1.0]
    if rep_rows:
        _apply_repetition(logits, metas, rep_rows)
    freq_rows = [i for i, m in enumerate(metas)
                 if (m.params.frequency_penalty != 0.0 or m.params.presence_penalty != 0.0)
                 and len(m.output_token_ids) > 0]
    if freq_rows:
        _apply_frequency_presence(logits, metas, freq_rows)


def min_tokens_banned(meta: "SamplingMeta", vocab: int) -> list[int]:
    """The token ids min_tokens masking sets to -inf for this row now (empty when it needs none). Ids
    outside the vocabulary can never be sampled, so there is nothing to mask for them."""
    if not needs_min_tokens_mask(meta):
        return []
    return sorted({int(t) for t in chain(meta.eos_token_ids, meta.params.stop_token_ids) if 0 <= t < vocab})


def apply_min_tokens_mask(logits: torch.Tensor, metas: Sequence["SamplingMeta"]) -> None:
    """Set EOS and stop-token logits to -inf, in place, for rows still short of min_tokens."""
    vocab = logits.shape[1]
    rows: list[int] = []
    tokens: list[int] = []
    for i, meta in enumerate(metas):
        ids = min_tokens_banned(meta, vocab)
        rows.extend([i] * len(ids))
        tokens.extend(ids)
    if rows:
        index = _index_tensors(rows, tokens, logits.device)
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def _apply_repetition(logits: torch.Tensor, metas: Sequence["SamplingMeta"], rows: list[int]) -> None:
    vocab = logits.shape[1]
    row_parts: list[torch.Tensor] = []
    token_parts: list[torch.Tensor] = []
    for i in rows:
        seen = _token_tensor(metas[i].prompt_token_ids, metas[i].output_token_ids)  # [n], may repeat
        _check_token_range(seen, vocab, i)
        row_parts.append(torch.full_like(seen, i))
        token_parts.append(seen)
    row_idx = torch.cat(row_parts).to(logits.device)      # [total_seen]
    tok_idx = torch.cat(token_parts).to(logits.device)    # [total_seen]
    penalty = torch.tensor([metas[i].params.repetition_penalty for i in range(len(metas))],
                           dtype=logits.dtype, device=logits.device)[row_idx]  # [total_seen]
    values = logits[row_idx, tok_idx]                      # gathered copy, [total_seen]
    values = torch.where(values > 0, values / penalty, values * penalty)
    # Repeated (row, token) pairs write the same value, so duplicates are harmless.
    logits.index_put_((row_idx, tok_idx), values)


def _apply_frequency_presence(logits: torch.Tensor, metas: Sequence["SamplingMeta"],
                              rows: list[int]) -> None:
    vocab = logits.shape[1]
    keys_parts: list[torch.Tensor] = []
    for i in rows:
        out = _token_tensor(metas[i].output_token_ids)
        _check_token_range(out, vocab, i)
        keys_parts.append(out + i * vocab)                 # flat key row * vocab + token
    keys, counts = torch.unique(torch.cat(keys_parts), return_counts=True)  # [num_distinct] each
    row_idx = keys // vocab
    tok_idx = keys % vocab
    freq = torch.tensor([m.params.frequency_penalty for m in metas], dtype=logits.dtype)
    pres = torch.tensor([m.params.presence_penalty for m in metas], dtype=logits.dtype)
    delta = freq[row_idx] * counts.to(logits.dtype) + pres[row_idx]   # [num_distinct]
    index = (row_idx.to(logits.device), tok_idx.to(logits.device))
    logits.index_put_(index, -delta.to(logits.device), accumulate=True)


def _token_tensor(*seqs: Sequence[int]) -> torch.Tensor:
    """Concatenate token id sequences (lists, tuples, arrays or CPU tensors) into one int64 CPU tensor."""
    parts = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs if len(s) > 0]
    if not parts:
        return torch.empty(0, dtype=torch.long)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _check_token_range(tokens: torch.Tensor, vocab: int, row: int) -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(f"row {row}: token ids must be in [0, {vocab}) for penalties, "
                         f"got min {int(tokens.min())} max {int(tokens.max())}")


def _index_tensors(rows: list[int], tokens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))
