"""The step-time model: how long one engine step takes, as a linear function of what it computes.

    step_s = intercept + per_decode_row * decode_rows + per_prefill_token * prefill_tokens
             + per_context_read * context_reads
             + per_prefill_step * prefill_steps + per_mixed_step * mixed_steps

- decode_rows: new tokens computed as decode rows: a request's one new token (a decode), and, in a step the
  platform's fused decode program runs, each of a request's few new tokens after its cached context (a
  speculative verify of 1 + k tokens is 1 + k rows there: DecodeRows says which steps those are);
- prefill_tokens: new tokens of every other scheduled request (prefill chunks; verify tokens in a step that
  runs per op);
- context_reads: (query token, cached key) pairs attention reads, sum over every new token of its position + 1
  (a decode at context c reads c; a chunk of n tokens from position s reads n * s + n * (n + 1) / 2);
- prefill_steps: 1 for a step with prefill tokens, else 0; mixed_steps: 1 for a step with prefill tokens and
  decode rows, else 0 (a steady-state mean step: the fraction of steps that carry prefill). Such a step
  runs per op where the platform has a fused decode program (CPU), or leaves the captured graph (CUDA): a
  fixed cost whatever the prefill's size, more where decode rows run beside it (on this project's CPUs,
  int4, steps of 0-32 decode rows and 8-128 prefill tokens: about 2.5 ms, and 2.2 ms more for a mixed
  step). It is what makes a prompt cut into many small pieces cost more than the sum of its tokens.

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

FEATURE_NAMES = ("intercept", "per_decode_row", "per_prefill_token", "per_context_read", "per_prefill_step",
                 "per_mixed_step")
_SCALE = np.array([1.0, 1.0, 1.0, 1e-3, 1.0, 1.0])     # context reads enter in thousands (conditioning)
_N = len(FEATURE_NAMES)
_STEP_COSTS = np.array([name in ("per_prefill_step", "per_mixed_step") for name in FEATURE_NAMES])


@dataclass(frozen=True)
class StepFeatures:
    """What one step computes. prefill_steps: None means what a real step has, 1 if it has prefill tokens
    else 0 (set on construction); a float in [0, 1] only for a forecast's mean step. A step is mixed as
    often as it carries prefill if it has decode rows."""
    decode_rows: int = 0
    prefill_tokens: int = 0
    context_reads: int = 0
    prefill_steps: float | None = None

    def __post_init__(self) -> None:
        if self.prefill_steps is None:
            object.__setattr__(self, "prefill_steps", 1.0 if self.prefill_tokens > 0 else 0.0)

    def values(self) -> tuple[float, ...]:
        """The regressors, in FEATURE_NAMES's order (unscaled)."""
        return (1.0, self.decode_rows, self.prefill_tokens, self.context_reads, self.prefill_steps,
                self.prefill_steps if self.decode_rows > 0 else 0.0)

    def vector(self) -> np.ndarray:
        return np.array(self.values()) * _SCALE

    def plus(self, other: "StepFeatures") -> "StepFeatures":
        """A real step with other's work added (prefill_steps as a real step's)."""
        return StepFeatures(self.decode_rows + other.decode_rows, self.prefill_tokens + other.prefill_tokens,
                            self.context_reads + other.context_reads)


NO_WORK = StepFeatures()


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


def chunk_work(start_position: int, num_new_tokens: int, rows: DecodeRows = PER_OP) -> tuple[int, int, int]:
    """What computing num_new_tokens from start_position adds to a step, as (decode rows, prefill tokens,
    context reads): decode rows where `rows` takes the chunk (as if the rest of its step qualified too),
    else prefill tokens. Plain ints: a budget adds one per grant, every step."""
    n, s = num_new_tokens, start_position
    reads = n * s + n * (n + 1) // 2
    return (n, 0, reads) if rows.takes(s, n) else (0, n, reads)


def chunk_features(start_position: int, num_new_tokens: int, rows: DecodeRows = PER_OP) -> StepFeatures:
    """chunk_work as StepFeatures."""
    return StepFeatures(*chunk_work(start_position, num_new_tokens, rows))


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
    step_cost_prior_weight: how many steps carrying it the prior of a per-step cost (per_prefill_step,
    per_mixed_step) counts for. These are constants of the platform, which the calibration's shapes tell
    apart; a live load shows them in few steps, of sizes too alike to tell them from the other terms (an
    Offline run: a handful of 2,000-token mixed steps among hundreds of decode steps), so a light pull
    would let them soak up those few steps' residuals (measured: 41 ms for a 0.5 ms prior).
    """

    def __init__(self, prior: dict[str, float] | None = None, decay: float = 0.995,
                 prior_weight: float = 4.0, rows: DecodeRows = PER_OP, step_cost_prior_weight: float = 64.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay, self.prior_weight, self.step_cost_prior_weight = decay, prior_weight, step_cost_prior_weight
        self.rows = rows                           # which new tokens the engine's platform runs as decode rows
        self._gram = np.zeros((_N, _N))            # sum of w * x x^T
        self._moment = np.zeros(_N)                # sum of w * x y
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
        # the pull scales with each feature's typical magnitude so that it means "rho observations"; a per-step
        # cost's feature is 1 in a step that carries it, so its pull means that many such steps
        pull = rho * np.maximum(np.diag(self._gram) / max(self._weight(), 1e-9), 1e-6)
        pull[_STEP_COSTS] = self.step_cost_prior_weight if self._has_prior else rho
        penalty = np.diag(pull)
        active = np.ones(_N, dtype=bool)           # coefficients not clamped at zero
        theta = np.zeros(_N)
        for _ in range(_N):
            a = (self._gram + penalty)[np.ix_(active, active)]
            b = (self._moment + penalty @ theta0)[active]
            theta = np.zeros(_N)
            theta[active] = np.linalg.lstsq(a, b, rcond=None)[0]
            negative = theta < 0
            if not negative.any():
                break
            active &= ~negative
        self._coeffs = tuple(float(v) for v in np.maximum(theta, 0.0) * _SCALE)    # s per unscaled feature
        self._stale = False

    def _weight(self) -> float:
        if self.decay == 1.0:
            return float(self.num_observations)
        return (1 - self.decay ** self.num_observations) / (1 - self.decay)

    # ---- predictions ------------------------------------------------------------------------------
    @property
    def coefficients(self) -> dict[str, float]:
        """Seconds per unit: intercept (s), per decode row, per prefill token, per context read; per step
        with prefill tokens, and per such step with decode rows too (beyond per_prefill_step)."""
        return dict(zip(FEATURE_NAMES, self._unscaled()))

    def _unscaled(self) -> tuple[float, ...]:
        """The coefficients in seconds per unscaled feature (kept with the fit: predict runs per grant)."""
        if self._stale:
            self._refit()
        return self._coeffs

    @property
    def is_fitted(self) -> bool:
        return self._has_prior or self.num_observations >= 8

    def predict(self, features: StepFeatures) -> float:
        """Predicted step time in seconds (>= 0)."""
        return max(sum(c * x for c, x in zip(self._unscaled(), features.values())), 0.0)

    def chunk_features(self, start_position: int, num_new_tokens: int) -> StepFeatures:
        """chunk_features under this model's DecodeRows."""
        return chunk_features(start_position, num_new_tokens, self.rows)

    def step_features(self, sched_out: SchedulerOutput) -> StepFeatures:
        """step_features under this model's DecodeRows."""
        return step_features(sched_out, self.rows)

    def chunk_marginal(self, start_position: int, num_new_tokens: int, step: StepFeatures = NO_WORK) -> float:
        """The time computing num_new_tokens from start_position adds to a step that already has `step`'s
        work (in a step that qualifies for the fused decode program where the chunk does: what a budget
        charges before the step is whole). A step's first prefill chunk adds per_prefill_step, and
        per_mixed_step where the step has decode rows; a later one adds only its tokens."""
        return self.marginal(self.chunk_features(start_position, num_new_tokens), step)

    def marginal(self, features: StepFeatures, step: StepFeatures = NO_WORK) -> float:
        """Predicted time `features`' work adds to a step that already has `step`'s (the intercept excluded)."""
        return max(self.predict(step.plus(features)) - self.predict(step), 0.0)

    def max_chunk(self, start_position: int, remaining: int, seconds: float, step: StepFeatures = NO_WORK) -> int:
        """The most new tokens (<= remaining) from start_position whose marginal time (chunk_marginal) fits
        in seconds."""
        if remaining <= 0 or seconds <= 0:
            return 0
        fits = lambda n: self.chunk_marginal(start_position, n, step) <= seconds
        if fits(remaining):
            return remaining
        # marginal time grows with the chunk, save where it crosses from decode rows to prefill tokens
        # (DecodeRows.max_query_len, where per_prefill_step also starts): bisect, which there may find a
        # fitting count short of the largest
        lo, hi = 0, remaining
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def describe(self) -> dict:
        """For reports: coefficients in milliseconds per unit, and the observation count."""
        c = self.coefficients
        return {"intercept_ms": 1e3 * c["intercept"], "per_decode_row_ms": 1e3 * c["per_decode_row"],
                "per_prefill_token_ms": 1e3 * c["per_prefill_token"],
                "per_1k_context_reads_ms": 1e6 * c["per_context_read"],
                "per_prefill_step_ms": 1e3 * c["per_prefill_step"],
                "per_mixed_step_ms": 1e3 * c["per_mixed_step"],
                "observations": self.num_observations, "prior": dict(self.prior),
                "decode_rows": {"max_query_len": self.rows.max_query_len, "max_rows": self.rows.max_rows},
                "coefficients": self.coefficients}


def server_bound(model: StepTimeModel, prompt_len: float, output_len: float, tpot_limit_s: float) -> dict:
    """The best output tokens/s the model allows with every step within tpot_limit_s, for requests of
    prompt_len -> output_len tokens in steady state: N decode rows per step, each step also carrying its
    share of prefill (N * prompt_len / output_len tokens) and its attention reads, and N / output_len
    prompts starting a step, each in the first step after it arrives (so a fraction f = min(1, N /
    output_len) of steps carries prefill, beside decode rows). N solves
    intercept + k * N + (per_prefill_step + per_mixed_step) * f = limit, and N / limit is the bound in
    tokens/s; 1 / k is the same model's limit for an unbounded batch (no latency limit)."""
    c = model.coefficients
    p, d = float(prompt_len), max(float(output_len), 1.0)
    reads_per_row = p + d / 2 + (p / d) * p / 2
    k = c["per_decode_row"] + c["per_prefill_token"] * p / d + c["per_context_read"] * reads_per_row
    room, o = max(tpot_limit_s - c["intercept"], 0.0), c["per_prefill_step"] + c["per_mixed_step"]
    if k <= 0:
        rows = float("inf")
    else:
        rows = room / (k + o / d)                      # fewer than one prompt a step (N < d)
        if rows >= d:
            rows = max(room - o, 0.0) / k              # every step carries a prompt
    return {"rows": rows, "tokens_per_s": rows / tpot_limit_s,
            "unbounded_batch_tokens_per_s": 1.0 / k if k > 0 else float("inf"),
            "step_s": tpot_limit_s, "prompt_len": p, "output_len": d}
