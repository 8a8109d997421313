"""How many more output tokens a running request will produce, learned from the requests that finished.

max_tokens is only a ceiling: chat and summarization requests mostly stop on EOS or a stop string well
before it. The SLO policy projects each request's TPOT over its remaining steps, so taking max_tokens as
the remaining length spreads one long step over steps that a short request never lives to see.

OutputLengths keeps the last `window` finished requests that could stop by themselves: a stop is an
observed natural length X; a request ended by max_tokens or aborted only says X > its length (censored).
The Kaplan-Meier product-limit estimate of S(t) = P(X > t) uses both without bias. For a request that has
produced n tokens (so X > n) with ceiling M, its remaining tokens R = min(X, M) - n >= 1 and
    P(R > j) = S(n + j) / S(n),  E[R] = sum_{t=n}^{M-1} S(t) / S(n).
Past the longest record S stays at its last value: requests still alive there run to their ceiling.
Until min_stops stops are recorded (or when no record outlived n) the estimate is the ceiling, M - n.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class OutputLengths:
    def __init__(self, window: int = 512, min_stops: int = 16) -> None:
        self.min_stops = min_stops
        self.records: deque[tuple[int, bool]] = deque(maxlen=window)   # (output tokens, stopped by itself)
        self._survival: np.ndarray | None = None   # S[t] = P(X > t), t = 0..T (T = the longest record)
        self._cumulative: np.ndarray | None = None  # _cumulative[t] = sum(S[:t]), t = 0..T+1
        self._descending: np.ndarray | None = None  # -S, non-decreasing: searchsorted finds quantiles
        self._dirty = False

    def record(self, num_output_tokens: int, stopped: bool) -> None:
        """A finished request: stopped (EOS, stop token or string) or censored (length limit, abort)."""
        self.records.append((max(int(num_output_tokens), 0), bool(stopped)))
        self._dirty = True

    @property
    def num_stops(self) -> int:
        return sum(stopped for _, stopped in self.records)

    def survival(self) -> np.ndarray | None:
        """S[t] = P(X > t) for t = 0..T, or None while fewer than min_stops stops are recorded."""
        if self._dirty:
            self._dirty = False
            self._survival = self._cumulative = None
            if self.num_stops >= self.min_stops:
                self._fit()
        return self._survival

    def _fit(self) -> None:
        lengths = np.fromiter((n for n, _ in self.records), dtype=np.int64)
        stopped = np.fromiter((s for _, s in self.records), dtype=bool)
        size = int(lengths.max()) + 1
        stops = np.bincount(lengths[stopped], minlength=size)              # d_t: stops at exactly t tokens
        ended = np.bincount(lengths, minlength=size)                       # stops and censored at t
        at_risk = np.cumsum(ended[::-1])[::-1]                             # n_t: records with X >= t
        hazard = np.divide(stops, at_risk, out=np.zeros(size), where=at_risk > 0)
        survival = np.cumprod(1.0 - hazard)
        self._survival, self._descending = survival, -survival
        self._cumulative = np.concatenate(([0.0], np.cumsum(survival)))

    def _s(self, t: int) -> float:
        s = self._survival
        return float(s[min(t, len(s) - 1)])

    def _sum_s(self, start: int, stop: int) -> float:
        """sum of S(t) for start <= t < stop, S constant past the longest record."""
        c, last = self._cumulative, len(self._survival) - 1

        def upto(t: int) -> float:
            return float(c[t]) if t <= last + 1 else float(c[last + 1]) + (t - last - 1) * self._s(last)
        return upto(stop) - upto(start)

    def expected_remaining(self, produced: int, ceiling: int) -> float:
        """E[remaining tokens] of a running request with `produced` tokens and at most `ceiling` in all."""
        cap = max(ceiling - produced, 1)
        if self.survival() is None or self._s(produced) <= 0.0:
            return float(cap)
        return min(self._sum_s(produced, produced + cap) / self._s(produced), float(cap))

    def remaining_quantile(self, produced: int, ceiling: int, q: float) -> int:
        """The smallest j >= 1 with P(remaining <= j) >= q: a fraction q of such requests end within j
        more tokens (the ceiling when too few end before it)."""
        cap = max(ceiling - produced, 1)
        s = self.survival()
        if s is None or self._s(produced) <= 0.0:
            return cap
        bar = (1.0 - q) * self._s(produced)
        # S is non-increasing: the first t > produced with S(t) <= bar, t = produced + j (O(log T), no copy)
        t = produced + 1 + int(np.searchsorted(self._descending[produced + 1:], -bar, side="left"))
        if t >= len(s):                       # not reached within the records: beyond them S stays put
            return cap
        return min(t - produced, cap)
