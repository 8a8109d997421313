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
work is limited to reading parameters, the seeded draws, the penalty index bookkeeping and one
threshold pass per truncated row. [rows, vocab] buffers are reused across steps (sample/workspace.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tokenmill.outputs import Logprob, TokenLogprobs
from tokenmill.sample.penalties import (apply_min_tokens_mask, apply_penalties, min_tokens_banned,
                                        needs_min_tokens_mask, needs_penalties)
from tokenmill.sample.truncation import (sample_inverse_cdf, scaled_probs_, truncation_thresholds,
                                         zero_below_)
from tokenmill.sample.topk import topk
from tokenmill.sample.workspace import Workspace
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
        self._workspace = Workspace()   # "processed", "probs" and "scratch" [rows, vocab] float32

    @staticmethod
    def make_generator(seed: int) -> torch.Generator:
        """A CPU generator for one request; CPU so seeded results do not depend on the device."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(_seed_to_uint64(seed))
        return generator

    @torch.inference_mode()   # always, so the reused workspace buffers are the same kind of tensor
    def __call__(self, logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> SamplerOutput:
        """logits: [num_rows, vocab] float (not modified). Returns one token (and logprobs) per row."""
        _check_inputs(logits, metas)
        if len(metas) == 0:
            return SamplerOutput([], [])
        if _is_plain_greedy(metas):
            return SamplerOutput(_argmax(logits).tolist(), [None] * len(metas))
        processed = self._process_logits(logits, metas)             # [rows, vocab] float32, read only
        token_ids = self._sample(processed, metas)                  # [rows] int64
        logprobs = self._logprobs(processed, metas, token_ids)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _process_logits(self, logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> torch.Tensor:
        """Penalties and min_tokens masking. Returns float32 [rows, vocab]: a modified copy when any row
        needs it, else `logits` itself (or its float32 cast); callers must treat it as read only."""
        logits = logits.detach().float()
        penalized = any(needs_penalties(m) for m in metas)
        masked = any(needs_min_tokens_mask(m) for m in metas)
        if not penalized and not masked:
            return logits
        processed = self._take("processed", *logits.shape, logits.device).copy_(logits)
        if penalized:
            apply_penalties(processed, metas)
        if masked:
            apply_min_tokens_mask(processed, metas)
        return processed

    def _sample(self, logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> torch.Tensor:
        """logits: [rows, vocab] processed (read only). Returns [rows] int64 on logits.device."""
        greedy = [i for i, m in enumerate(metas) if m.params.greedy]
        random = [i for i, m in enumerate(metas) if not m.params.greedy]
        token_ids = torch.empty(len(metas), dtype=torch.long, device=logits.device)
        if greedy:
            index = _index(greedy, logits.device)
            # A full-batch argmax is cheaper than gathering the greedy rows first on CPU.
            token_ids[index] = _argmax(logits)[index] if logits.device.type == "cpu" \
                else logits[index].argmax(dim=-1)
        if random:
            sampled = self._sample_random(logits, random, [metas[i] for i in random])
            token_ids[_index(random, logits.device)] = sampled
        return token_ids

    def _sample_random(self, logits: torch.Tensor, rows: list[int],
                       metas: Sequence[SamplingMeta]) -> torch.Tensor:
        """Sample rows `rows` of logits [num_rows, vocab] (pre-temperature, read only); metas: theirs.
        Returns [len(rows)] int64 token ids."""
        probs = self.target_probs(self._gather(logits, rows, "probs", copy=True), metas, rows)
        return sample_inverse_cdf(probs, self._uniforms(metas))

    @staticmethod
    def target_probs(logits: torch.Tensor, metas: Sequence[SamplingMeta], rows: list[int] | None = None) -> torch.Tensor:
        """In place: logits [n, vocab] (pre-temperature, a copy the caller owns) -> the unnormalized
        probabilities the rows sample from: temperature, then top-k / top-p / min-p truncation (max 1).
        rows: the rows' batch indices, for error messages."""
        row_max = _finite_row_max(logits, rows if rows is not None else list(range(len(metas))))   # [n]
        temperature, top_k, top_p, min_p = _row_params(metas)                        # [n] each, CPU
        scaled_probs_(logits, row_max, temperature)
        zero_below_(logits, truncation_thresholds(logits, top_k, top_p, min_p))
        return logits

    def uniform(self, meta: SamplingMeta) -> float:
        """One U[0, 1) draw for a row: from its own generator when seeded, else the shared one."""
        g = meta.generator if meta.generator is not None else self.generator
        return torch.rand(1, generator=g, device=g.device).item()

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

    def _logprobs(self, logits: torch.Tensor, metas: Sequence[SamplingMeta],
                  token_ids: torch.Tensor) -> list[TokenLogprobs | None]:
        """log_softmax of the processed (pre-temperature) logits for rows that asked; `top` sorted
        descending."""
        result: list[TokenLogprobs | None] = [None] * len(metas)
        rows = [i for i, m in enumerate(metas) if m.params.logprobs is not None]
        if not rows:
            return result
        selected = self._gather(logits, rows, "scratch")                            # [n, vocab]
        log_probs = torch.log_softmax(selected, dim=-1,
                                      out=self._take("probs", *selected.shape, logits.device))
        sampled_ids = token_ids[_index(rows, logits.device)]                        # [n]
        sampled = log_probs.gather(1, sampled_ids[:, None]).squeeze(1).tolist()
        max_k = min(max(metas[i].params.logprobs for i in rows), log_probs.shape[1])
        top_values, top_ids = topk(log_probs, max_k)                                # [n, max_k]
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for j, (i, token) in enumerate(zip(rows, sampled_ids.tolist())):
            k = metas[i].params.logprobs
            top = [Logprob(t, v) for t, v in zip(top_ids[j][:k], top_values[j][:k])]
            result[i] = TokenLogprobs(sampled=Logprob(token, sampled[j]), top=top)
        return result

    def _take(self, name: str, rows: int, vocab: int, device, dtype=torch.float32) -> torch.Tensor:
        return self._workspace.take(name, rows, vocab, dtype, device)

    def _gather(self, x: torch.Tensor, rows: list[int], buffer: str, copy: bool = False) -> torch.Tensor:
        """x[rows] ([len(rows), vocab]) in workspace buffer `buffer`; x itself when rows is all of x
        and no copy is asked for."""
        if len(rows) == x.shape[0] and not copy:
            return x
        out = self._take(buffer, len(rows), x.shape[1], x.device)
        if len(rows) == x.shape[0]:
            return out.copy_(x)
        return torch.index_select(x, 0, _index(rows, x.device), out=out)


def _is_plain_greedy(metas: Sequence[SamplingMeta]) -> bool:
    """True when argmax of the raw logits is the whole answer for every row."""
    return all(m.params.greedy and m.params.logprobs is None and not needs_penalties(m)
               and not needs_min_tokens_mask(m) for m in metas)


def argmax_bans(metas: Sequence[SamplingMeta], vocab: int) -> list[list[int]] | None:
    """When every row's token is the argmax of its raw logits over the tokens not banned (greedy, no
    logprobs, no penalties; min_tokens masking bans EOS and stop ids), the banned ids per row; else None.
    Lets a caller that can find such an argmax without the logits (layers/greedy_head.py) skip them: the
    tokens __call__ gives, up to logits that tie within float32 rounding (exact ties: the lowest id)."""
    if not all(m.params.greedy and m.params.logprobs is None and not needs_penalties(m) for m in metas):
        return None
    return [min_tokens_banned(m, vocab) for m in metas]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, first index on ties. [rows, vocab] -> [rows] int64. On CPU numpy's SIMD argmax
    is ~10x faster than torch's."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        import numpy as np
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def _row_params(metas: Sequence[SamplingMeta]) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p) as [n] CPU tensors."""
    params = [m.params for m in metas]
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


def _finite_row_max(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[n, vocab] -> [n] row maxima; ValueError naming the batch rows whose maximum is not finite."""
    row_max = logits.amax(dim=-1)
    finite = torch.isfinite(row_max)
    if not bool(finite.all()):
        bad = [rows[j] for j in (~finite).nonzero().flatten().tolist()]
        raise ValueError(f"sampler: rows {bad} have no finite best logit (all masked, or inf/NaN)")
    return row_max


def _check_inputs(logits: torch.Tensor, metas: Sequence[SamplingMeta]) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"sampler: logits must be a float tensor [num_rows, vocab], got {shape}")
    if logits.shape[0] != len(metas):
        raise ValueError(f"sampler: logits have {logits.shape[0]} rows but {len(metas)} metas were given")


def _index(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _seed_to_uint64(seed: int) -> int:
    return seed % (1 << 64)
