"""Verifying draft tokens against the target model (speculative decoding), losslessly.

For one request with drafts d_1..d_k and the target's logits at the k + 1 positions they imply
(position i predicts the token after d_1..d_i):
- greedy: accept while d_i is the target's argmax; then the target's own token at the first mismatch
  (or after the last draft): exactly the tokens decoding without drafts gives;
- sampling: rejection sampling (Leviathan et al. 2023). Every proposer's draft is certain (q one-hot: an
  n-gram match, a draft model's or MTP head's greedy token), where the rule "accept d_i with probability
  min(1, p(d_i) / q(d_i)), else sample from norm(max(p - q, 0)) and stop" reads: accept with p(d_i), else
  sample from p with d_i removed. It is realized by one draw a position: x_i ~ p_i (the sampler's own
  inverse-CDF draw from one uniform number); accept while x_i == d_i (probability p(d_i)); at the first
  x_i != d_i emit x_i and stop (x_i is then distributed as p_i without d_i); all accepted: the bonus token
  x_{k+1} ~ p_{k+1}. The accepted run plus that token is distributed exactly as sampling from p token by
  token, and it uses exactly one uniform number per emitted token, the same number the plain sampler would
  use for that token: a seeded request (its own generator) gives the same tokens with or without drafts,
  whatever number of drafts each step carried. p is the distribution the sampler would draw from
  (temperature, top-k, top-p, min-p).

min_tokens masking applies per position (EOS and stop tokens banned at the positions still short of it).
Relaxed acceptance (opt-in, lossy, greedy only): a draft among the target's top-N within delta of the best
probability is accepted too (TensorRT-LLM's relaxed acceptance for reasoning models).
Requests with penalties or logprobs are not speculated on (the engine core proposes no drafts for them):
their per-position processing would depend on the accepted prefix.
"""
from __future__ import annotations

import torch

from tokenmill.sample.sampler import Sampler, SamplingMeta, _argmax
from tokenmill.sample.truncation import sample_inverse_cdf


def verify(sampler: Sampler, logits: torch.Tensor, drafts: list[int], meta: SamplingMeta,
           relaxed: tuple[int, float] | None = None) -> list[int]:
    """logits [len(drafts) + 1, vocab] float32 (read only) -> the accepted drafts and one token more.
    relaxed (top_n, delta): greedy rows also accept a draft among the target's top_n whose probability is
    within delta of the best (LOSSY: the output is no longer exactly greedy)."""
    logits = _min_tokens_masked(logits, meta)
    if meta.params.greedy:
        also = None if relaxed is None else (lambda i: _close_enough(logits[i], drafts[i], *relaxed))
        return accept_greedy(drafts, _argmax(logits).tolist(), also)
    probs = Sampler.target_probs(logits.float().clone(), [meta] * logits.shape[0])      # [k + 1, vocab]
    for i, draft in enumerate(drafts):
        token = _draw(sampler, probs[i], meta)               # x_i ~ p_i, one uniform number
        if token != draft:
            return drafts[:i] + [token]                      # rejected: x_i replaces it
    return drafts + [_draw(sampler, probs[-1], meta)]        # all accepted: the bonus token


def accept_greedy(drafts: list[int], target: list[int], also=None) -> list[int]:
    """Greedy verification: the drafts accepted while each is the target's token at its position (or
    also(i) holds: relaxed acceptance), then the target's token where the run stops. target: the target's
    tokens at the len(drafts) + 1 positions."""
    accepted = 0
    while accepted < len(drafts) and (drafts[accepted] == target[accepted] or (also is not None and also(accepted))):
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


def rows_short_of_min_tokens(meta: SamplingMeta, rows: int) -> int:
    """How many of a request's next `rows` output positions are still short of min_tokens (EOS and stop
    tokens banned there)."""
    return max(0, min(rows, meta.params.min_tokens - len(meta.output_token_ids)))


def _close_enough(row: torch.Tensor, draft: int, top_n: int, delta: float) -> bool:
    probs = torch.softmax(row.float(), dim=-1)
    top = torch.topk(probs, min(top_n, probs.numel()))
    return draft in top.indices.tolist() and float(probs[draft]) >= float(top.values[0]) - delta


def _min_tokens_masked(logits: torch.Tensor, meta: SamplingMeta) -> torch.Tensor:
    """Row i is the request's output token number len(outputs) + i: while that is short of min_tokens, EOS
    and the stop tokens are banned there, as the sampler bans them one token at a time."""
    vocab = logits.shape[1]
    banned = [t for t in (*meta.eos_token_ids, *meta.params.stop_token_ids) if 0 <= t < vocab]   # as the sampler
    rows = rows_short_of_min_tokens(meta, logits.shape[0])
    if not banned or rows == 0:
        return logits
    logits = logits.clone()
    logits[:rows, torch.tensor(banned, dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def _draw(sampler: Sampler, row: torch.Tensor, meta: SamplingMeta) -> int:
    return int(sample_inverse_cdf(row[None], torch.tensor([sampler.uniform(meta)]))[0])


def speculation_applies(params, num_output_tokens: int) -> bool:
    """Whether drafts may be proposed for a request now (see the module docstring)."""
    return (params.logprobs is None and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)
