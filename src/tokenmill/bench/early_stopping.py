"""MLPerf LoadGen's early-stopping estimate (one-sided binomial test).

With `t` of `n = h + t` queries over the latency limit, the run certifies "the p-th percentile is within
the limit" at confidence `c` when the chance of seeing at most `t` overlatency queries, were the true
underlatency fraction only `p`, is below `1 - c`:

    P(Binomial(h + t, 1 - p) <= t) < 1 - c

`min_underlatency_queries(t, p)` is the smallest such `h`; the run needs `h + t` queries in all.
Known answers (c = 0.99): with t = 0, p99 needs 459 queries and p90 44; with t = 1 (the smallest run
that yields an early-stopping percentile estimate, where the worst query sits at the estimate),
p99 needs 662 and p90 64, the figures MLPerf quotes (MultiStream's min_query_count = 662).
LoadGen's Server check counts t = queries strictly over the limit and requires `issued >= h + t`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_CONFIDENCE = 0.99


def _log_binom_cdf(t: int, n: int, q_fail: float) -> float:
    """log P(Binomial(n, q_fail) <= t), summed in log space (stable for n up to millions)."""
    log_q, log_p = math.log(q_fail), math.log1p(-q_fail)
    terms = [
        math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1) + x * log_q + (n - x) * log_p
        for x in range(0, min(t, n) + 1)
    ]
    top = max(terms)
    return top + math.log(sum(math.exp(v - top) for v in terms))


def overlatency_odds(h: int, t: int, percentile: float) -> float:
    """Chance of at most t overlatency queries among h + t when the true underlatency rate is `percentile`."""
    return math.exp(_log_binom_cdf(t, h + t, 1.0 - percentile))


@lru_cache(maxsize=4096)
def min_underlatency_queries(t: int, percentile: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Smallest h with overlatency_odds(h, t, percentile) < 1 - confidence."""
    if not 0.0 < percentile < 1.0:
        raise ValueError(f"early stopping percentile must be in (0, 1), got {percentile}")
    if t < 0:
        raise ValueError(f"overlatency query count must be >= 0, got {t}")
    alpha = 1.0 - confidence
    lo, hi = 1, max(2, math.ceil(math.log(alpha) / math.log(percentile)))
    while overlatency_odds(hi, t, percentile) >= alpha:   # widen until it passes
        lo, hi = hi, hi * 2
    while lo < hi:                                         # odds fall as h grows
        mid = (lo + hi) // 2
        if overlatency_odds(mid, t, percentile) < alpha:
            hi = mid
        else:
            lo = mid + 1
    return lo


def min_queries(t: int, percentile: float, confidence: float = DEFAULT_CONFIDENCE) -> int:
    """Queries a run must hold (h + t) to certify `percentile` with t overlatency queries."""
    return min_underlatency_queries(t, percentile, confidence) + t


@dataclass(frozen=True)
class EarlyStoppingResult:
    metric: str                    # "TTFT" | "TPOT"
    passed: bool
    num_queries: int               # queries issued
    num_overlatency: int           # queries strictly over the limit
    min_queries_needed: int        # h + t
    percentile: float

    def message(self) -> str:
        if self.passed:
            return f"{self.metric}: run successful ({self.num_queries} queries, {self.num_overlatency} over the limit)"
        more = self.min_queries_needed - self.num_queries
        return (f"{self.metric}: early stopping not satisfied: {self.num_queries} queries with "
                f"{self.num_overlatency} over the limit; would need {more} more queries, all under the limit, "
                f"to certify p{self.percentile * 100:g} at {DEFAULT_CONFIDENCE:.0%} confidence")


def server_early_stopping(metric: str, values_s: list[float], num_issued: int, limit_s: float,
                          percentile: float, confidence: float = DEFAULT_CONFIDENCE) -> EarlyStoppingResult:
    """LoadGen's Server rule: t = values strictly over the limit; pass when issued >= h(t) + t."""
    t = sum(1 for v in values_s if v > limit_s)
    needed = min_queries(t, percentile, confidence)
    return EarlyStoppingResult(metric, num_issued >= needed, num_issued, t, needed, percentile)
