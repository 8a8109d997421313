"""The step-time model: how long one engine step takes, as a linear function of what it computes.

    step_s = intercept + per_decode_row * decode_rows + per_prefill_token * prefill_tokens
             + per_context_read * context_reads

- decode_rows: new tokens computed as decode rows: a request's one new token (a decode), and, in a step the
  platform's fused decode program runs, each of a request's few new tokens after its cached context (a
  speculative verify of 1 + k tokens is 1 + k rows there: DecodeRows says which steps those are);
- prefill_tokens: new tokens of every other scheduled request (prefill chunks; verify tokens in a step that
  runs per op);
- context_reads: (query token, cached key) pairs attention reads, sum over every new token of its position + 1
  (a decode at context c reads c; a chunk of n tokens from position s reads n * s + n * (n + 1) / 2).

A step's time is its period, what a decoding request's TPOT is made of: from its start to the next step's
start while requests remain (output processing and streaming included), its own time before the engine
idles (engine/engine_core.py). The fit is online: every executed step is an observation, weighted by recency
(exponential forgetting), and pulled toward a prior (the start-up calibration's coefficients) so that a few
steps of one shape do not swing the coefficients of the others. Coefficients are kept >= 0. Times are seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenmill.core.messages import SchedulerOutput

FEATURE_NAMES = ("intercept", "per_decode_row", "per_prefill_token", "per_context_read")
_SCALE = np.array([1.0, 1.0, 1.0, 1e-3])     # context reads enter in thousands (conditioning)


@dataclass(frozen=True)
class StepFeatures:
    decode_rows: int = 0
    prefill_tokens: int = 0
    context_reads: int = 0

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.decode_rows, self.prefill_tokens, self.context_reads]) * _SCALE


@dataclass(frozen=True)
class DecodeRows:
    """Which steps compute a request's several new tokens as decode rows, one row a token: those the
    platform's fused decode program takes (platforms/cpu_decode.py), where every request brings
    1..max_query_len new tokens after a context already cached (start position >= 1, single tokens
    included) and there are at most max_rows new tokens in all. Any other step runs per op: a request's one
    new token is a decode row there, longer chunks (a prefill, a verify) are prefill tokens. max_query_len 1
    (the default): no such program, or one for plain decodes only (CUDA graphs), so only single tokens are
    rows."""
    max_query_len: int = 1
    max_rows: int = 0                 # with max_query_len > 1: the program's most rows a step

    def takes(self, start_position: int, num_new_tokens: int) -> bool:
        """One request's chunk may be decode rows (its step must qualify as a whole, see step_features)."""
        return num_new_tokens == 1 or (num_new_tokens <= self.max_query_len and start_position >= 1)


PER_OP = DecodeRows()


def chunk_features(start_position: int, num_new_tokens: int, rows: DecodeRows = PER_OP) -> StepFeatures:
    """What computing num_new_tokens from start_position adds to a step: decode rows where `rows` takes the
    chunk (as if the rest of its step qualified too), else prefill tokens."""
    n, s = num_new_tokens, start_position
    reads = n * s + n * (n + 1) // 2
    if rows.takes(s, n):
        return StepFeatures(decode_rows=n, context_reads=reads)
    return StepFeatures(prefill_tokens=n, context_reads=reads)


def step_features(sched_out: SchedulerOutput, rows: DecodeRows = PER_OP) -> StepFeatures:
    """The step's features (one pass, no per-request objects: it runs every step). Every new token is a
    decode row where the fused decode program takes the whole step; otherwise only single ones are."""
    singles = multi = reads = 0
    fused = rows.max_query_len > 1
    for sr in sched_out.scheduled:
        n, s = len(sr.token_ids), sr.start_position
        reads += n * s + n * (n + 1) // 2
        if n == 1:
            singles += 1
        else:
            multi += n
        fused = fused and n <= rows.max_query_len and s >= 1     # a first chunk, even of 1 token, is a prefill
    if fused and multi and singles + multi <= rows.max_rows:
        return StepFeatures(singles + multi, 0, reads)
    return StepFeatures(singles, multi, reads)


class StepTimeModel:
    """Online weighted least squares of step time on StepFeatures.

    decay: weight kept by each past observation per new one (0.995: a half-life of about 140 steps).
    prior_weight: how many observations' worth the prior coefficients count for, per feature.
    """

    def __init__(self, prior: dict[str, float] | None = None, decay: float = 0.995,
                 prior_weight: float = 4.0, rows: DecodeRows = PER_OP) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay, self.prior_weight = decay, prior_weight
        self.rows = rows                           # which new tokens the engine's platform runs as decode rows
        self._gram = np.zeros((4, 4))              # sum of w * x x^T
        self._moment = np.zeros(4)                 # sum of w * x y
        self.num_observations = 0
        self.set_prior(prior)

    def set_prior(self, prior: dict[str, float] | None) -> None:
        """Coefficients the fit is pulled toward (seconds per unit of each feature); None: none (zeros,
        with a vanishing pull, so that the data alone decide)."""
        self.prior = {k: float((prior or {}).get(k, 0.0)) for k in FEATURE_NAMES}
        self._has_prior = prior is not None
        self._stale = True

    # ---- observations -------------------------------------------------------------------------------
    def observe(self, features: StepFeatures, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        x = features.vector()
        self._gram = self.decay * self._gram + np.outer(x, x)
        self._moment = self.decay * self._moment + x * seconds
        self.num_observations += 1
        self._stale = True                         # refit when next asked (a policy that never asks pays nothing)

    def _refit(self) -> None:
        theta0 = np.array([self.prior[k] for k in FEATURE_NAMES]) / _SCALE
        rho = self.prior_weight if self._has_prior else 1e-6
        # the pull scales with each feature's typical magnitude so that it means "rho observations"
        diag = np.maximum(np.diag(self._gram) / max(self._weight(), 1e-9), 1e-6)
        penalty = rho * np.diag(diag)
        active = np.ones(4, dtype=bool)            # coefficients not clamped at zero
        theta = np.zeros(4)
        for _ in range(4):
            a = (self._gram + penalty)[np.ix_(active, active)]
            b = (self._moment + penalty @ theta0)[active]
            theta = np.zeros(4)
            theta[active] = np.linalg.lstsq(a, b, rcond=None)[0]
            negative = theta < 0
            if not negative.any():
                break
            active &= ~negative
        self._theta = np.maximum(theta, 0.0)
        self._stale = False

    @property
    def theta(self) -> np.ndarray:
        """The fitted coefficients in the scaled feature units."""
        if self._stale:
            self._refit()
        return self._theta

    def _weight(self) -> float:
        if self.decay == 1.0:
            return float(self.num_observations)
        return (1 - self.decay ** self.num_observations) / (1 - self.decay)

    # ---- predictions ------------------------------------------------------------------------------
    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit: intercept (s), per decode row, per prefill token, per context read."""
        return {k: float(v) for k, v in zip(FEATURE_NAMES, self.theta * _SCALE)}

    @property
    def is_fitted(self) -> bool:
        return self._has_prior or self.num_observations >= 8

    def predict(self, features: StepFeatures) -> float:
        """Predicted step time in seconds (>= 0)."""
        return max(float(features.vector() @ self.theta), 0.0)

    def chunk_features(self, start_position: int, num_new_tokens: int) -> StepFeatures:
        """chunk_features under this model's DecodeRows."""
        return chunk_features(start_position, num_new_tokens, self.rows)

    def step_features(self, sched_out: SchedulerOutput) -> StepFeatures:
        """step_features under this model's DecodeRows."""
        return step_features(sched_out, self.rows)

    def chunk_marginal(self, start_position: int, num_new_tokens: int) -> float:
        """The marginal time of computing num_new_tokens from start_position (in a step that qualifies for
        the fused decode program where the chunk does: what a budget charges before the step is whole)."""
        return self.marginal(self.chunk_features(start_position, num_new_tokens))

    def marginal(self, features: StepFeatures) -> float:
        """Predicted time this work adds to a step that already runs (the intercept excluded)."""
        x = features.vector()
        x[0] = 0.0
        return max(float(x @ self.theta), 0.0)

    def max_chunk(self, start_position: int, remaining: int, seconds: float) -> int:
        """The most new tokens (<= remaining) from start_position whose marginal time fits in seconds."""
        if remaining <= 0 or seconds <= 0:
            return 0
        if self.chunk_marginal(start_position, remaining) <= seconds:
            return remaining
        # marginal time grows with the chunk, save where it crosses from decode rows to prefill tokens
        # (DecodeRows.max_query_len): bisect, which there may find a fitting count short of the largest
        lo, hi = 0, remaining
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.chunk_marginal(start_position, mid) <= seconds else (lo, mid)
        return lo

    def describe(self) -> dict:
        """For reports: coefficients in milliseconds per unit, and the observation count."""
        c = self.coefficients
        return {"intercept_ms": 1e3 * c["intercept"], "per_decode_row_ms": 1e3 * c["per_decode_row"],
                "per_prefill_token_ms": 1e3 * c["per_prefill_token"],
                "per_1k_context_reads_ms": 1e6 * c["per_context_read"],
                "observations": self.num_observations, "prior": dict(self.prior),
                "decode_rows": {"max_query_len": self.rows.max_query_len, "max_rows": self.rows.max_rows},
                "coefficients": self.coefficients}


def server_bound(model: StepTimeModel, prompt_len: float, output_len: float, tpot_limit_s: float) -> dict:
    """The best output tokens/s the model allows with every step within tpot_limit_s, for requests of
    prompt_len -> output_len tokens in steady state: N decode rows per step, each step also carrying its
    share of prefill (N * prompt_len / output_len tokens) and its attention reads. A step of N rows costs
    intercept + k * N, so N = (limit - intercept) / k rows and N / limit tokens/s; 1 / k is the same model's
    limit for an unbounded batch (no latency limit)."""
    c = model.coefficients
    p, d = float(prompt_len), max(float(output_len), 1.0)
    reads_per_row = p + d / 2 + (p / d) * p / 2
    k = c["per_decode_row"] + c["per_prefill_token"] * p / d + c["per_context_read"] * reads_per_row
    rows = max(tpot_limit_s - c["intercept"], 0.0) / k if k > 0 else float("inf")
    return {"rows": rows, "tokens_per_s": rows / tpot_limit_s,
            "unbounded_batch_tokens_per_s": 1.0 / k if k > 0 else float("inf"),
            "step_s": tpot_limit_s, "prompt_len": p, "output_len": d}
