"""Load-adaptive draft length: each step, the k (among 0, max_k / 2 and max_k) expected to give the batch
the most output tokens per second, so speculation turns itself off when the batch is compute-bound and
back on when it is not.

Two sources, per batch-size bucket (1, 2-3, 4-7, ... decoding requests):
- measured: recency-weighted seconds and tokens per step of the steps that ran with each k (the
  acceptance is in the tokens); a step's seconds are its period (its start to the next step's start, as
  the step-time model's observations: engine/engine_core.py), so measured and predicted rates agree;
- predicted, while a k has too few measurements there: the step-time model (core/step_time.py, the SLO
  scheduler's model: n chunks of 1 + k tokens instead of n decode rows) and the measured per-position
  acceptance alpha, E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per request.
Exploration: a k next to the best one (in choices' order) is tried again every `explore_every` steps of the
bucket, so a choice made under one load is revisited under another; each time that k measured clearly
worse than the best (below `explore_keep` of its rate) the interval doubles, up to `explore_max`, so a
batch where speculation only loses pays for at most one trial step in explore_max (a trial at batch 64
can take twice a normal step)."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.step_time import StepFeatures, StepTimeModel


@dataclass
class _Measured:
    seconds: float = 0.0          # weighted sums
    tokens: float = 0.0
    weight: float = 0.0


class AdaptiveDraftLength:
    min_measured = 2.0            # weight of measurements before they replace the prediction
    explore_every = 16            # steps of a bucket between trials of a neighbouring k (at first)
    explore_max = 1024
    explore_keep = 0.9

    def __init__(self, max_k: int, prior_alpha: float = 0.5, prior_weight: float = 8.0, decay: float = 0.95) -> None:
        self.max_k, self.decay = max_k, decay
        self.choices = sorted({0, max_k // 2, max_k})
        self.accepted, self.trials = prior_alpha * prior_weight, prior_weight
        self.measured: dict[tuple[int, int], _Measured] = {}
        self.steps: dict[int, int] = {}
        self.explore_interval: dict[tuple[int, int], int] = {}     # (bucket, k) -> steps between trials
        self.next_trial: dict[tuple[int, int], int] = {}           # (bucket, k) -> the bucket's step count
        self.last_k = max_k                       # the latest choice (observability)

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return max(num_decoding, 1).bit_length()

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.trials, 0.999) if self.trials else 0.0

    def observe_request(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verified step (for alpha)."""
        self.accepted = self.accepted * 0.99 + num_accepted
        self.trials = self.trials * 0.99 + num_accepted + (1 if num_accepted < num_draft_tokens else 0)

    def observe_step(self, k: int, num_decoding: int, seconds: float, tokens: int) -> None:
        """A step that ran with draft length k for num_decoding decoding requests and produced `tokens`."""
        m = self.measured.setdefault((self.bucket(num_decoding), k), _Measured())
        m.seconds = m.seconds * self.decay + seconds
        m.tokens = m.tokens * self.decay + tokens
        m.weight = m.weight * self.decay + 1.0

    def expected_tokens(self, k: int) -> float:
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self, model: StepTimeModel, positions: list[int]) -> int:
        """k for the requests about to decode at `positions` (their next token's position)."""
        if not positions:
            return self.last_k
        b = self.bucket(len(positions))
        step = self.steps[b] = self.steps.get(b, 0) + 1
        rates = {c: self._rate(model, positions, b, c) for c in self.choices}
        k = max(self.choices, key=lambda c: (rates[c], -c))
        i = self.choices.index(k)
        for c in self.choices[max(i - 1, 0):i + 2]:
            if c != k and step >= self.next_trial.setdefault((b, c), step + self.explore_every):
                self._schedule_next_trial(b, c, step, rates[c] < self.explore_keep * rates[k])
                k = c
                break
        self.last_k = k
        return k

    def _schedule_next_trial(self, b: int, c: int, step: int, clearly_worse: bool) -> None:
        interval = self.explore_interval.get((b, c), self.explore_every)
        interval = min(2 * interval, self.explore_max) if clearly_worse else self.explore_every
        self.explore_interval[(b, c)] = interval
        self.next_trial[(b, c)] = step + interval

    def _rate(self, model: StepTimeModel, positions: list[int], b: int, k: int) -> float:
        m = self.measured.get((b, k))
        if m is not None and m.weight >= self.min_measured and m.seconds > 0:
            return m.tokens / m.seconds
        rows = prefill = reads = 0
        for p in positions:
            f = model.chunk_features(p, 1 + k)
            rows, prefill, reads = rows + f.decode_rows, prefill + f.prefill_tokens, reads + f.context_reads
        return len(positions) * self.expected_tokens(k) / max(model.predict(StepFeatures(rows, prefill, reads)), 1e-9)
