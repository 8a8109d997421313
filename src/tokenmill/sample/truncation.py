"""Temperature, top-k / top-p / min-p truncation and the random draw, vectorized over rows.

Every truncation rule is turned into a per-row threshold on the (pre-temperature) logits: a token is kept
iff its logit >= the row's threshold. Dividing by a temperature T > 0 is monotonic, so thresholds found in
logit space hold at any temperature; ties at the threshold are all kept. Rules apply in this order, each
on the distribution left by the previous one: top_k, then top_p (on softmax(logits / T) renormalized over
the top-k survivors), then min_p (drop tokens with prob < min_p * max prob; the max is never dropped).

The draw is inverse-CDF sampling over the vocabulary in token-id order with ONE uniform number per row,
taken from that row's generator. A row's token therefore depends only on its own logits, parameters and
generator state, never on the batch around it, and each step consumes exactly one draw per random row.
(One draw instead of an exponential race over the vocabulary: Tensor.exponential_ costs ~60 ms for
64 x 49152 on this CPU, and CPU generators keep seeded results identical on any device.)
"""
from __future__ import annotations

import torch

# top_p: look for the nucleus among this many best tokens first; rows whose nucleus is bigger fall back
# to a full sort (a full sort of 64 x 49152 costs ~100 ms on CPU, a top-256 about 5 ms).
TOP_P_FIRST_CANDIDATES = 256


def top_k_thresholds(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Logit of each row's k-th best token. logits: [rows, vocab]; top_k: [rows] int64, 0 = off.

    Returns [rows] float: -inf where top_k is off (0 or >= vocab)."""
    vocab = logits.shape[1]
    active = (top_k > 0) & (top_k < vocab)                           # [rows] bool
    thresholds = torch.full_like(logits[:, 0], float("-inf"))       # [rows]
    if not bool(active.any()):
        return thresholds
    rows = active.nonzero().squeeze(1)
    k = top_k[rows]
    best = torch.topk(logits[rows], int(k.max()), dim=-1).values    # [active, k_max], descending
    thresholds[rows] = best.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    return thresholds


def min_p_thresholds(row_max: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """prob < min_p * max_prob  <=>  logit < max_logit + T * log(min_p). All args and result: [rows]."""
    return row_max + temperature * torch.log(min_p)                 # log(0) = -inf: rule off


def top_p_thresholds(logits: torch.Tensor, scaled_probs: torch.Tensor, row_max: torch.Tensor,
                     temperature: torch.Tensor, top_p: torch.Tensor,
                     floor: torch.Tensor) -> torch.Tensor:
    """Logit of the last token of each row's nucleus: the smallest set of best tokens whose mass >= p.

    logits: [rows, vocab] pre-temperature; scaled_probs: [rows, vocab] = exp((logits - row_max) / T),
    already zeroed below `floor` (the top-k thresholds), i.e. unnormalized probabilities; row_max,
    temperature, top_p, floor: [rows]. Returns [rows] float, -inf where top_p == 1.
    """
    thresholds = torch.full_like(row_max, float("-inf"))
    rows = (top_p < 1.0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return thresholds
    mass = top_p[rows] * scaled_probs[rows].sum(-1)                 # [n] target unnormalized mass
    args = (row_max[rows], temperature[rows], floor[rows], mass)
    k_first = min(TOP_P_FIRST_CANDIDATES, logits.shape[1])
    best = torch.topk(logits[rows], k_first, dim=-1).values         # [n, k_first], descending
    found, resolved = _nucleus_threshold(best, *args)
    if not bool(resolved.all()) and k_first < logits.shape[1]:
        late = (~resolved).nonzero().squeeze(1)
        late_args = tuple(a[late] for a in args)
        ordered = _sort_descending(logits[rows[late]])              # [late, vocab]
        found[late], _ = _nucleus_threshold(ordered, *late_args)
    thresholds[rows] = found
    return thresholds


def _nucleus_threshold(best: torch.Tensor, row_max, temperature, floor, mass):
    """best: [n, k] logits sorted descending. Returns (threshold [n], resolved [n] bool).

    Token j is in the nucleus iff the mass of the tokens before it is < the target mass; a row is
    resolved when the k candidates reach the target (else its nucleus extends past them)."""
    probs = torch.exp((best - row_max[:, None]) / temperature[:, None])   # [n, k] unnormalized
    probs = probs.masked_fill(best < floor[:, None], 0.0)
    cum = torch.cumsum(probs, dim=-1)                                      # [n, k]
    mass_before = torch.nn.functional.pad(cum[:, :-1], (1, 0))             # exclusive cumsum
    num_keep = (mass_before < mass[:, None]).sum(-1).clamp(min=1)          # [n] >= 1
    threshold = best.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
    return threshold, cum[:, -1] >= mass


def _sort_descending(x: torch.Tensor) -> torch.Tensor:
    """Values of each row sorted descending (indices not needed). numpy's sort is ~2x torch's on CPU."""
    if x.device.type == "cpu":
        import numpy as np
        return -torch.from_numpy(np.sort(-x.numpy(), axis=-1))
    return torch.sort(x, dim=-1, descending=True, stable=False).values


def sample_inverse_cdf(scaled_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row. scaled_probs: [rows, vocab] unnormalized, >= 0, each row with a positive
    entry; consumed (turned into its cumulative sum in place). uniforms: [rows] in [0, 1).

    Returns [rows] int64 token ids. Token i is chosen iff cdf[i-1] <= u * total < cdf[i], so a token with
    zero probability can never be chosen."""
    cdf = scaled_probs.cumsum_(dim=-1)                                     # [rows, vocab]
    total = cdf[:, -1]
    target = uniforms.to(cdf.dtype) * total
    # u * total may round up to total; the target must stay strictly below it.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
