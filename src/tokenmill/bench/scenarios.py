"""Arrival patterns (MLPerf scenarios), separate from the dataset and the SUT.

A scenario only says *when* each query is due and which sample it carries. Open-loop scenarios
(Offline, Server) build their whole schedule before the run; the closed-loop `ConcurrencyScenario`
issues the next query when one completes.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledQuery:
    query_index: int          # order of issue
    sample_index: int         # which dataset sample it carries
    scheduled_s: float        # s after the run start


def sample_order(num_samples: int, num_queries: int, seed: int) -> list[int]:
    """Sample indices for `num_queries` queries: seeded shuffles of the dataset, repeated as needed.

    Every sample is used once before any repeats (no sorting by length; MLPerf forbids it).
    """
    if num_samples <= 0:
        raise ValueError("the dataset has no samples")
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < num_queries:
        block = list(range(num_samples))
        rng.shuffle(block)
        order.extend(block)
    return order[:num_queries]


@dataclass(frozen=True)
class OfflineScenario:
    """Every sample issued at t = 0 as one query."""
    num_queries: int          # samples in the one query
    seed: int = 0
    name: str = "Offline"
    open_loop: bool = True

    def schedule(self, num_samples: int) -> list[ScheduledQuery]:
        order = sample_order(num_samples, self.num_queries, self.seed)
        return [ScheduledQuery(i, s, 0.0) for i, s in enumerate(order)]


# LoadGen's kSlack: its Offline query holds floor(1.1 x min duration x offline_expected_qps) samples, at least
# min_query_count (loadgen/test_settings_internal.cc)
OFFLINE_HEADROOM = 1.1


def offline_query_size(samples: int, duration_s: float, min_duration_s: float, most: int) -> int:
    """Samples for an Offline query that lasts at least `min_duration_s` at the rate a run of `samples`
    samples in `duration_s` s showed: that rate as LoadGen's offline_expected_qps, times the minimum
    duration and LoadGen's 1.1 headroom; never fewer than `samples`, at most `most`."""
    if samples <= 0 or most < samples:
        raise ValueError(f"need 0 < samples <= most, got samples={samples}, most={most}")
    if not duration_s > 0:
        return most
    wanted = math.floor(OFFLINE_HEADROOM * min_duration_s * (samples / duration_s))
    return max(samples, min(most, wanted))


@dataclass(frozen=True)
class ServerScenario:
    """Poisson arrivals at `target_qps` from a seeded Mersenne Twister (Python's `random.Random`).

    The schedule holds at least `min_query_count` queries and runs until at least `min_duration_s`
    (like LoadGen, which keeps generating until both minimums hold), capped at `max_query_count`.
    """
    target_qps: float         # queries per second
    min_duration_s: float     # s
    min_query_count: int
    max_query_count: int | None = None
    seed: int = 0
    name: str = "Server"
    open_loop: bool = True

    def __post_init__(self) -> None:
        if not (self.target_qps > 0 and math.isfinite(self.target_qps)):
            raise ValueError(f"target_qps must be a positive number, got {self.target_qps}")

    def arrival_times(self) -> list[float]:
        rng = random.Random(self.seed)
        times: list[float] = []
        t = 0.0
        while len(times) < self.min_query_count or t < self.min_duration_s:
            if self.max_query_count is not None and len(times) >= self.max_query_count:
                break
            t += rng.expovariate(self.target_qps)
            times.append(t)
        return times

    def schedule(self, num_samples: int) -> list[ScheduledQuery]:
        times = self.arrival_times()
        order = sample_order(num_samples, len(times), self.seed + 1)
        return [ScheduledQuery(i, s, t) for i, (s, t) in enumerate(zip(order, times))]


@dataclass(frozen=True)
class ConcurrencyScenario:
    """Closed loop: `concurrency` users, each sends its next query when its previous one completes.

    A query is scheduled at the moment its slot frees, so TTFT here has no queueing in the client.
    """
    concurrency: int
    num_queries: int
    seed: int = 0
    name: str = "Concurrency"
    open_loop: bool = False

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def schedule(self, num_samples: int) -> list[ScheduledQuery]:
        order = sample_order(num_samples, self.num_queries, self.seed)
        return [ScheduledQuery(i, s, math.nan) for i, s in enumerate(order)]


Scenario = OfflineScenario | ServerScenario | ConcurrencyScenario
