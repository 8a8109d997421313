"""Temperature, top-k / top-p / min-p truncation and the random draw, vectorized over rows.

Everything works on unnormalized probabilities p = exp((logit - max_logit) / T), so the best token has
p == 1 exactly. Every truncation rule becomes a per-row threshold on p (a token is kept iff p >= the
threshold; ties at the threshold are all kept), applied in this order, each on what the previous left:
  top_k: keep the k best;
  top_p: keep the smallest set of best tokens whose mass is >= top_p (of the top-k survivors' mass);
  min_p: keep p >= min_p (p is already relative to the max prob; the best token is never dropped).
Tokens with p < PROB_FLOOR (1e-37, far below float32 resolution of a sum near 1) are always dropped:
the exponent is clamped so exp never produces denormals, which cost ~30x on CPU.

The draw is inverse-CDF sampling over the vocabulary in token-id order with ONE uniform number per row,
taken from that row's generator. A row's token therefore depends only on its own logits, parameters and
generator state, never on the batch around it, and each step consumes exactly one draw per random row.
(One draw rather than an exponential race over the vocabulary: Tensor.exponential_ costs ~60 ms for
64 x 49152 on CPU, and CPU generators keep seeded results identical on any device.) The uniform has
24 bits, so token probabilities are resolved to about 6e-8.

Per-row parameter tensors (top_k, top_p, min_p, temperature) live on the CPU so deciding which rows a
rule touches never synchronizes with an accelerator.
"""
from __future__ import annotations

import torch

from tokenmill.sample.topk import topk

PROB_FLOOR = 1e-37                  # p below this (relative to the max prob) is dropped
MIN_SCALED_LOGIT = -87.0            # exp(-87) = 1.6e-38 < PROB_FLOOR, still a normal float32
# top_p: stages of candidate counts for the nucleus search, then a full sort. Per 49152-token row on
# this CPU: top-64 ~0.05 ms, top-1024 ~1 ms, full sort ~3 ms.
TOP_P_CANDIDATES = (64, 1024)
SAMPLE_CHUNK = 1024                 # tokens per chunk of the two-level inverse-CDF draw


def scaled_probs_(logits: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """In place: logits [n, vocab] -> exp(max((x - row_max) / T, -87)), max entry 1.
    row_max: [n] finite row maxima of logits; temperature: [n] > 0 (CPU or logits.device)."""
    inv_t = (1.0 / temperature).to(device=logits.device, dtype=logits.dtype)
    return logits.sub_(row_max[:, None]).mul_(inv_t[:, None]).clamp_(min=MIN_SCALED_LOGIT).exp_()


def truncation_thresholds(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          min_p: torch.Tensor) -> torch.Tensor:
    """Per-row keep threshold on p. probs: [n, vocab] from scaled_probs_ (read only here);
    top_k [n] int (0 = off), top_p [n], min_p [n], all CPU. Returns [n] on probs.device."""
    threshold = min_p.clamp(min=PROB_FLOOR).to(device=probs.device, dtype=probs.dtype)   # [n]
    k_threshold = top_k_thresholds(probs, top_k)                                  # [n], 0 = off
    threshold = torch.maximum(threshold, k_threshold)
    if bool((top_p < 1.0).any()):
        threshold = torch.maximum(threshold, top_p_thresholds(probs, top_p, k_threshold))
    return threshold


def top_k_thresholds(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """p of each row's k-th best token. probs: [n, vocab]; top_k: [n] CPU int, 0 = off.
    Returns [n], 0 where off (0 or >= vocab)."""
    vocab = probs.shape[1]
    thresholds = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    active = ((top_k > 0) & (top_k < vocab)).nonzero().squeeze(1)              # [a] CPU
    if active.numel() == 0:
        return thresholds
    best, _ = topk(probs, int(top_k[active].max()), rows=active)               # [a, k_max] descending
    k = top_k[active].to(probs.device)
    thresholds[active.to(probs.device)] = best.gather(1, (k - 1)[:, None]).squeeze(1)
    return thresholds


def top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """p of the last token of each row's nucleus, among the tokens with p >= floor (the top-k survivors).
    probs: [n, vocab] (read only); top_p: [n] CPU; floor: [n]. Returns [n], 0 where top_p == 1.

    The nucleus is looked for among the best TOP_P_CANDIDATES[0] tokens first; rows whose nucleus is
    bigger move on to the next stage, and finally to a full sort of the row."""
    vocab = probs.shape[1]
    thresholds = torch.zeros(probs.shape[0], dtype=probs.dtype, device=probs.device)
    active = (top_p < 1.0).nonzero().squeeze(1).to(probs.device)               # [a]
    if active.numel() == 0:
        return thresholds
    floor = floor[active]                                                       # [a]
    mass = top_p[active.cpu()].to(probs.device, probs.dtype) * _mass_at_least(probs, active, floor)
    found = torch.zeros_like(mass)
    pending = torch.arange(active.numel(), device=probs.device)                 # rows still looking
    for num_candidates in TOP_P_CANDIDATES + (vocab,):
        rows = active[pending]
        if num_candidates < vocab:
            best = topk(probs, num_candidates, rows=rows)[0]                    # [p, c] descending
        else:
            best = _sort_descending(probs[rows])                                # [p, vocab]
        found[pending], resolved = _nucleus_threshold(best, mass[pending], floor[pending])
        pending = pending[~resolved]
        if num_candidates >= vocab or pending.numel() == 0:
            break
    thresholds[active] = found
    return thresholds


def _mass_at_least(probs: torch.Tensor, rows: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Sum of p >= floor in each of `rows`. probs: [n, vocab]; rows, floor: [a]. Returns [a]."""
    mass = probs.sum(-1)[rows]                                                  # [a]
    cut = (floor > 0).nonzero().squeeze(1)
    if cut.numel():
        kept = zero_below_(probs[rows[cut]], floor[cut])                        # copy of those rows
        mass[cut] = kept.sum(-1)
    return mass


def _nucleus_threshold(best: torch.Tensor, mass: torch.Tensor,
                       floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """best: [a, c] probabilities sorted descending; mass: [a] target; floor: [a] (entries below it do
    not count). Returns (threshold [a], resolved [a] bool). Token j is in the nucleus iff the mass of
    the tokens before it is < the target; a row is resolved when its c candidates reach the target
    (else the nucleus extends past them)."""
    best = best * (best >= floor[:, None])
    cum = torch.cumsum(best, dim=-1)                                            # [a, c]
    mass_before = torch.nn.functional.pad(cum[:, :-1], (1, 0))                  # exclusive cumsum
    num_keep = (mass_before < mass[:, None]).sum(-1).clamp(min=1)               # [a] >= 1
    threshold = best.gather(1, (num_keep - 1)[:, None]).squeeze(1)
    return threshold, cum[:, -1] >= mass


def zero_below_(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """In place: probs[i, j] = 0 where probs[i, j] < threshold[i]. probs: [n, vocab]; threshold: [n].

    Only rows that have an entry below their threshold are touched, each with one vectorized
    torch.threshold_ pass (a batched lt + where was ~50x slower on CPU)."""
    below = (probs.amin(dim=-1) < threshold).nonzero().flatten().tolist()
    if not below:
        return probs
    # threshold_ keeps x > t; the largest float below the threshold turns that into x >= threshold.
    strict = torch.nextafter(threshold, torch.full_like(threshold, float("-inf"))).tolist()
    for i in below:
        torch.threshold_(probs[i], strict[i], 0.0)
    return probs


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row. probs: [n, vocab] >= 0, each row with a positive entry; uniforms: [n] in [0, 1).
    Returns [n] int64. Token i is chosen iff cdf[i-1] <= u * total < cdf[i] (cdf in token-id order), so a
    token with zero probability is never chosen.

    Two levels, to avoid a cumulative sum over the whole vocabulary: pick the chunk of SAMPLE_CHUNK
    tokens that holds the target mass, then the token inside that chunk."""
    n, vocab = probs.shape
    chunk_cdf = torch.cumsum(_chunk_sums(probs), dim=-1)                        # [n, num_chunks]
    target = uniforms.to(device=probs.device, dtype=probs.dtype) * chunk_cdf[:, -1]
    chunk, local_target = _search(chunk_cdf, target)                           # [n] each
    columns = chunk[:, None] * SAMPLE_CHUNK + torch.arange(SAMPLE_CHUNK, device=probs.device)
    in_vocab = columns < vocab                                                  # last chunk may be short
    local = probs.gather(1, columns.clamp(max=vocab - 1)) * in_vocab           # [n, SAMPLE_CHUNK]
    offset, _ = _search(torch.cumsum(local, dim=-1), local_target.clamp(min=0))
    return chunk * SAMPLE_CHUNK + offset


def _chunk_sums(probs: torch.Tensor) -> torch.Tensor:
    """[n, vocab] -> [n, ceil(vocab / SAMPLE_CHUNK)] sums of consecutive token chunks (views, no copy)."""
    n, vocab = probs.shape
    num_full = vocab // SAMPLE_CHUNK
    sums = probs[:, :num_full * SAMPLE_CHUNK].reshape(n, num_full, SAMPLE_CHUNK).sum(-1)
    if vocab % SAMPLE_CHUNK:
        sums = torch.cat([sums, probs[:, num_full * SAMPLE_CHUNK:].sum(-1, keepdim=True)], dim=1)
    return sums


def _search(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cdf: [n, m] non-decreasing with cdf[:, -1] > 0; target: [n] >= 0. Returns (index [n] of the first
    entry > target, target - the cdf before that entry [n]). The target is first clamped strictly below
    the total, so the chosen entry always has positive mass."""
    total = cdf[:, -1]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target[:, None], right=True)               # [n, 1]
    before = torch.where(index > 0, cdf.gather(1, (index - 1).clamp(min=0)), 0.0)
    return index.squeeze(1), target - before.squeeze(1)


def _sort_descending(x: torch.Tensor) -> torch.Tensor:
    """Values of each row sorted descending (indices not needed). numpy's sort is ~2x torch's on CPU."""
    if x.device.type == "cpu":
        import numpy as np
        return torch.from_numpy(np.sort(x.numpy(), axis=-1)[:, ::-1].copy())
    return torch.sort(x, dim=-1, descending=True, stable=False).values
