"""What one step does for a decoding request: the new tokens it computes and the output tokens it yields.

Without speculation a decoding request computes one token a step (one decode row) and yields one output
token. With speculation it computes 1 + d tokens (its token and d drafts, as many as the step's budget
granted) and yields 1 + a (a: the drafts accepted). A TPOT is time per output token, so the SLO policy's
forecasts (core/slo_policy.py) need both: the step's cost from what it computes, the TPOT from what it
yields. The scheduler measures them on its decoding requests (DecodeYieldMeter, recency-weighted means per
request step) where speculation is on; PLAIN is the exact no-speculation case.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.core.step_time import StepFeatures


@dataclass(frozen=True)
class DecodeYield:
    """Means per decoding request per step. decode_rows and prefill_tokens split its new tokens as the
    step-time model counts them (core/step_time.py: a verify chunk is decode rows where the platform's fused
    decode program takes it, else prefill tokens); self_reads: the attention reads of its new tokens among
    themselves, q * (q + 1) / 2 for q new tokens; output_tokens: what it yields (>= 1)."""
    decode_rows: float = 1.0
    prefill_tokens: float = 0.0
    self_reads: float = 1.0
    output_tokens: float = 1.0

    @property
    def new_tokens(self) -> float:
        return self.decode_rows + self.prefill_tokens

    def features(self, num_requests: int, start_positions: int) -> StepFeatures:
        """A decode-only step of num_requests decoding requests whose new tokens start at positions summing
        to start_positions (rounded to whole units; PLAIN gives exactly n decode rows reading
        start_positions + n pairs)."""
        q = self.new_tokens
        return StepFeatures(round(num_requests * self.decode_rows), round(num_requests * self.prefill_tokens),
                            round(q * start_positions + num_requests * self.self_reads))

    def steps_for(self, tokens: int) -> int:
        """Steps a request needs for `tokens` more output tokens (>= 1 for any tokens > 0)."""
        return max(math.ceil(tokens / self.output_tokens), 0)


PLAIN = DecodeYield()


class DecodeYieldMeter:
    """Recency-weighted means of DecodeYield over decoding request steps (decay: weight each past one keeps
    per new one; 0.995: a half-life of about 140 request steps)."""

    def __init__(self, decay: float = 0.995) -> None:
        self.decay = decay
        self._sums = [0.0] * 5            # weight, decode rows, prefill tokens, self reads, output tokens

    def record(self, new_tokens: StepFeatures, output_tokens: int) -> None:
        """One decoding request's step: new_tokens: its chunk's features (decode rows or prefill tokens);
        output_tokens: the tokens the step sampled for it."""
        q = new_tokens.decode_rows + new_tokens.prefill_tokens
        x = (1.0, new_tokens.decode_rows, new_tokens.prefill_tokens, q * (q + 1) / 2, output_tokens)
        self._sums = [self.decay * s + v for s, v in zip(self._sums, x)]

    @property
    def current(self) -> DecodeYield:
        """The means so far (PLAIN before any request step)."""
        w, rows, prefill, reads, out = self._sums
        if w <= 0.0:
            return PLAIN
        return DecodeYield(rows / w, prefill / w, reads / w, max(out / w, 1.0))
