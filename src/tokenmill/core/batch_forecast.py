"""What the decode batch will be over the coming steps, for the SLO policy's admission test.

A request's MLPerf TPOT is the mean step time over its whole decode, so what matters when admitting one is
not the next step but the batch over the next hundred: running requests leave as their remaining steps run
out (their remaining tokens over what a step yields them: core/decode_yield.py), and new ones arrive at the
recent arrival rate, each staying about the mean remaining steps. Batch at
step j (1-based) = #{running r: remaining_r >= j} + rate * step_s * min(j, mean_output). Step time at batch b
is intercept + per_row * b (per_row carrying each row's share of prefill and attention reads).
"""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from tokenmill.core.decode_yield import PLAIN, DecodeYield


class ArrivalRate:
    """Requests per second over the last window_s seconds of arrivals (seconds on the scheduler's clock),
    measured over at least min_span_s, so that a burst of simultaneous arrivals does not read as a rate."""

    def __init__(self, window_s: float = 60.0, max_events: int = 1024, min_span_s: float = 10.0) -> None:
        self.window_s, self.min_span_s = window_s, min_span_s
        self.times: deque[float] = deque(maxlen=max_events)

    def add(self, t: float) -> None:
        self.times.append(t)

    def rate(self, now: float) -> float:
        while self.times and self.times[0] < now - self.window_s:
            self.times.popleft()
        if len(self.times) < 2:
            return 0.0
        return (len(self.times) - 1) / max(now - self.times[0], self.min_span_s)


@dataclass(frozen=True)
class BatchForecast:
    remaining: tuple[int, ...]        # remaining steps of each request in the batch, ascending (without
                                      # speculation: its remaining output tokens)
    new_per_step: float               # expected arrivals per step (rate * step seconds)
    mean_output: float                # steps an arrival stays
    intercept_s: float
    per_row_s: float                  # a request's share of a step (its rows, its prefill share, its reads)
    decode_yield: DecodeYield = PLAIN   # what a step computes and yields per request (speculation)
    _prefix: tuple[int, ...] = field(init=False, repr=False)   # _prefix[i] = sum(remaining[:i])

    def __post_init__(self) -> None:
        object.__setattr__(self, "remaining", tuple(sorted(self.remaining)))
        object.__setattr__(self, "_prefix", tuple(itertools.accumulate(self.remaining, initial=0)))

    def batch_sum(self, steps: int) -> float:
        """Sum over steps j = 1..steps of the expected batch size (O(log batch))."""
        i = bisect.bisect_right(self.remaining, steps)            # requests leaving within `steps`
        running = self._prefix[i] + steps * (len(self.remaining) - i)
        d = max(self.mean_output, 1.0)
        full = min(steps, int(d))                  # steps j <= d count j arrivals still in, later ones d
        arrivals = full * (full + 1) / 2 + d * (steps - full)
        return running + self.new_per_step * arrivals

    def time_s(self, steps: int) -> float:
        """Predicted seconds of the next `steps` steps."""
        return steps * self.intercept_s + self.per_row_s * self.batch_sum(steps)

    def mean_step_s(self, steps: int) -> float:
        return self.time_s(steps) / steps if steps > 0 else 0.0
