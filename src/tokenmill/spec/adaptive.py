"""Load-adaptive draft length: each step, the k in 0..max_k that maximizes the batch's expected output
tokens per second, from the measured acceptance and the step-time model (core/step_time.py, the SLO
scheduler's model: a decode row is cheap when a step is memory-bound, a draft token costs what a prefill
token costs).

With per-position acceptance alpha (drafts are accepted as a run until the first rejection), a request
drafting k tokens yields E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens per step. For the n requests that
decode next, k costs the step the time of n chunks of 1 + k tokens instead of n decode rows:
    k* = argmax_k  n E(k) / predict(intercept + n chunks of 1 + k tokens at their positions)
so speculation turns itself off (k* = 0) when the batch is compute-bound, and back on when it is not.

alpha is a recency-weighted estimate over the steps that carried drafts (successes: accepted drafts;
trials: those plus one rejection where the run stopped short), starting from a neutral prior."""
from __future__ import annotations

from tokenmill.core.step_time import StepFeatures, StepTimeModel, chunk_features


class AdaptiveDraftLength:
    def __init__(self, max_k: int, prior_alpha: float = 0.5, prior_weight: float = 8.0, decay: float = 0.99) -> None:
        self.max_k, self.decay = max_k, decay
        self.accepted, self.trials = prior_alpha * prior_weight, prior_weight
        self.last_k = max_k                       # observability: the latest choice

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.trials, 0.999) if self.trials else 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verified step."""
        self.accepted = self.accepted * self.decay + num_accepted
        self.trials = self.trials * self.decay + num_accepted + (1 if num_accepted < num_draft_tokens else 0)

    def expected_tokens(self, k: int) -> float:
        a = self.alpha
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self, model: StepTimeModel, positions: list[int]) -> int:
        """k for requests about to decode at `positions` (their next token's position); 0: no drafts."""
        if not positions:
            return self.max_k
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            rows = prefill = reads = 0
            for p in positions:
                f = chunk_features(p, 1 + k)
                rows, prefill, reads = rows + f.decode_rows, prefill + f.prefill_tokens, reads + f.context_reads
            seconds = model.predict(StepFeatures(rows, prefill, reads))
            rate = len(positions) * self.expected_tokens(k) / max(seconds, 1e-9)
            if rate > best_rate * 1.0001:                # a longer draft must actually pay
                best_k, best_rate = k, rate
        self.last_k = best_k
        return best_k
