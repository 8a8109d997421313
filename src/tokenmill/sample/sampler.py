"""The sampler: one call per engine step turns the last-position logits of every row into a token.

Processing order for each row (vLLM / OpenAI semantics):
  1. penalties (repetition over prompt + output, then frequency / presence over output) and min_tokens
     masking of EOS + stop_token_ids (see sample/penalties.py);
  2. logprobs, when requested, are log_softmax of these processed logits BEFORE temperature and
     truncation (vLLM's "processed_logprobs"): they describe the model plus penalties, independent of
     how the user chose to sample;
  3. greedy rows (temperature < 1e-5, see SamplingParams.greedy): argmax, no randomness;
  4. other rows: temperature, top_k, top_p, min_p, then one inverse-CDF draw (sample/truncation.py).

Reproducibility: a row's random draw comes from its own generator when it has one (seeded requests),
else from the sampler's shared generator, exactly one uniform number per random row per step. A seeded
row therefore gets the same tokens whatever shares the batch and whatever its row index.

Cost: when every row is greedy with no penalties, no logprobs and no min_tokens masking the step is a
single argmax over the batch. Otherwise the [rows, vocab] work is vectorized over rows; per-row Python
work is limited to reading parameters, the seeded draws and the penalty index bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tokenmill.outputs import Logprob, TokenLogprobs
from tokenmill.sample.penalties import (apply_min_tokens_mask, apply_penalties,
                                        needs_min_tokens_mask, needs_penalties)
from tokenmill.sample.truncation import (min_p_thresholds, sample_inverse_cdf, top_k_thresholds,
                                         top_p_thresholds)
from tokenmill.sampling_params import SamplingParams


@dataclass
class SamplingMeta:
    """What the sampler needs to know about one row of the batch."""
    params: SamplingParams
    generator: torch.Generator | None   # per-request (Sampler.make_generator(params.seed)), same object
                                        # every step; None: draw from the sampler's shared generator
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]     # tokens generated so far (penalties, min_tokens)
    eos_token_ids: Sequence[int]        # masked with params.stop_token_ids while short of min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]                          # [num_rows]
    logprobs: list[TokenLogprobs | None]          # [num_rows]; None where params.logprobs is None


class Sampler:
    def __init__(self, seed: int | None = None):
        # Shared generator for unseeded rows; a fresh nondeterministic seed when none is given.
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(_seed_to_uint64(seed))

    @staticmethod
    def make_generator(seed: int) -> torch.Generator:
        """A CPU generator for one request; CPU so seeded results do not depend on the device."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(_seed_to_uint64(seed))
        return generator

    def __call__(self, logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> SamplerOutput:
        """logits: [num_rows, vocab] float (not modified). Returns one token (and logprobs) per row."""
        _check_inputs(logits, metas)
        if len(metas) == 0:
            return SamplerOutput([], [])
        if _is_plain_greedy(metas):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(metas))
        processed = _process_logits(logits, metas)                  # [rows, vocab] float32
        token_ids = self._sample(processed, metas)                  # [rows] int64
        logprobs = _compute_logprobs(processed, metas, token_ids)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> torch.Tensor:
        """logits: [rows, vocab] processed (read only). Returns [rows] int64 on logits.device."""
        greedy = [i for i, m in enumerate(metas) if m.params.greedy]
        random = [i for i, m in enumerate(metas) if not m.params.greedy]
        token_ids = torch.empty(len(metas), dtype=torch.long, device=logits.device)
        if greedy:
            index = _index(greedy, logits.device)
            token_ids[index] = _take_rows(logits, greedy, index).argmax(dim=-1)
        if random:
            index = _index(random, logits.device)
            sampled = self._sample_random(_take_rows(logits, random, index), [metas[i] for i in random])
            token_ids[index] = sampled
        return token_ids

    def _sample_random(self, logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> torch.Tensor:
        """logits: [n, vocab] processed, pre-temperature (read only). Returns [n] int64 token ids."""
        device = logits.device
        temperature = _param_tensor(metas, "temperature", torch.float32, device)   # [n], > 0
        top_k = _param_tensor(metas, "top_k", torch.long, device)                  # [n], 0 = off
        top_p = _param_tensor(metas, "top_p", torch.float32, device)               # [n]
        min_p = _param_tensor(metas, "min_p", torch.float32, device)               # [n]

        row_max = logits.amax(dim=-1)                                               # [n]
        if not bool(torch.isfinite(row_max).all()):
            bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
            raise ValueError(f"sampler: rows {bad} have no finite logit (all masked, or inf/NaN)")
        # Unnormalized probabilities at temperature T: exp((x - max) / T), max entry exactly 1.
        probs = (logits - row_max[:, None]).div_(temperature[:, None]).exp_()       # [n, vocab]
        floor = top_k_thresholds(logits, top_k)                                     # [n]
        threshold = torch.maximum(floor, min_p_thresholds(row_max, temperature, min_p))
        if any(m.params.top_p < 1.0 for m in metas):
            if any(0 < m.params.top_k < logits.shape[1] for m in metas):
                probs.masked_fill_(logits < floor[:, None], 0.0)   # top_p sees only top-k survivors
            nucleus = top_p_thresholds(logits, probs, row_max, temperature, top_p, floor)
            threshold = torch.maximum(threshold, nucleus)
        if bool((threshold > float("-inf")).any()):
            probs.masked_fill_(logits < threshold[:, None], 0.0)
        return sample_inverse_cdf(probs, self._uniforms(metas).to(device))

    def _uniforms(self, metas: Sequence[SamplingMeta]) -> torch.Tensor:
        """One U[0, 1) draw per row: seeded rows from their own generator, the rest from the shared one."""
        uniforms = torch.empty(len(metas), dtype=torch.float32)                     # [n], CPU
        shared = [j for j, m in enumerate(metas) if m.generator is None]
        if shared:
            uniforms[shared] = torch.rand(len(shared), generator=self.generator)
        for j, meta in enumerate(metas):
            if meta.generator is not None:
                g = meta.generator
                uniforms[j] = torch.rand(1, generator=g, device=g.device).item()
        return uniforms


def _is_plain_greedy(metas: Sequence[SamplingMeta]) -> bool:
    """True when argmax of the raw logits is the whole answer for every row."""
    return all(m.params.greedy and m.params.logprobs is None and not needs_penalties(m)
               and not needs_min_tokens_mask(m) for m in metas)


def _process_logits(logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> torch.Tensor:
    """Penalties and min_tokens masking. Returns float32 [rows, vocab]: a modified copy when any row
    needs processing, else `logits` itself (or its float32 cast); callers must treat it as read only."""
    logits = logits.float()
    penalized = [m for m in metas if needs_penalties(m)]
    masked = [m for m in metas if needs_min_tokens_mask(m)]
    if not penalized and not masked:
        return logits
    processed = logits.clone()
    if penalized:
        apply_penalties(processed, metas)
    if masked:
        apply_min_tokens_mask(processed, metas)
    return processed


def _compute_logprobs(logits: torch.Tensor, metas: Sequence[SamplingMeta],
                      token_ids: torch.Tensor) -> list[TokenLogprobs | None]:
    """log_softmax of the processed logits for rows that asked; top list sorted descending."""
    result: list[TokenLogprobs | None] = [None] * len(metas)
    rows = [i for i, m in enumerate(metas) if m.params.logprobs is not None]
    if not rows:
        return result
    index = _index(rows, logits.device)
    log_probs = torch.log_softmax(_take_rows(logits, rows, index), dim=-1)          # [n, vocab]
    sampled_ids = token_ids[index]                                                  # [n]
    sampled = log_probs.gather(1, sampled_ids[:, None]).squeeze(1).tolist()
    max_k = max(metas[i].params.logprobs for i in rows)
    top_values, top_ids = torch.topk(log_probs, min(max_k, log_probs.shape[1]), dim=-1)  # [n, max_k]
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, (i, token) in enumerate(zip(rows, sampled_ids.tolist())):
        k = metas[i].params.logprobs
        top = [Logprob(t, v) for t, v in zip(top_ids[j][:k], top_values[j][:k])]
        result[i] = TokenLogprobs(sampled=Logprob(token, sampled[j]), top=top)
    return result


def _check_inputs(logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"sampler: logits must be a float tensor [num_rows, vocab], got {shape}")
    if logits.shape[0] != len(metas):
        raise ValueError(f"sampler: logits have {logits.shape[0]} rows but {len(metas)} metas were given")


def _param_tensor(metas: Sequence[SamplingMeta], name: str, dtype, device) -> torch.Tensor:
    return torch.tensor([getattr(m.params, name) for m in metas], dtype=dtype, device=device)


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _take_rows(x: torch.Tensor, rows: list[int], index: torch.Tensor) -> torch.Tensor:
    """x[index] without a copy when the rows are all of x, in order."""
    return x if len(rows) == x.shape[0] else x[index]


def _seed_to_uint64(seed: int) -> int:
    return seed % (1 << 64)
