"""Arrival schedules: Poisson statistics, seeding, minimums."""
import math
import statistics

import pytest

from tokenmill.bench.scenarios import ConcurrencyScenario, OfflineScenario, ServerScenario, sample_order


def test_poisson_schedule_statistics():
    sc = ServerScenario(target_qps=50.0, min_duration_s=0.0, min_query_count=20000, seed=7)
    times = sc.arrival_times()
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 50.0, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(mean, rel=0.05)    # exponential: std == mean
    # P(gap > mean) = e^-1 for an exponential
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    # arrivals in 1 s windows: Poisson, variance == mean
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert statistics.fmean(counts) == pytest.approx(50, rel=0.05)
    assert statistics.pvariance(counts) == pytest.approx(50, rel=0.3)


def test_schedule_is_seeded_and_made_before_the_run():
    a = ServerScenario(2.0, 10.0, 5, seed=3).schedule(7)
    b = ServerScenario(2.0, 10.0, 5, seed=3).schedule(7)
    c = ServerScenario(2.0, 10.0, 5, seed=4).schedule(7)
    assert a == b and a != c
    assert all(x.scheduled_s < y.scheduled_s for x, y in zip(a, a[1:]))


def test_server_minimums_and_cap():
    times = ServerScenario(10.0, min_duration_s=5.0, min_query_count=3, seed=0).arrival_times()
    assert times[-1] >= 5.0 and times[-2] < 5.0
    assert len(ServerScenario(1.0, 0.0, 300, seed=0).arrival_times()) == 300
    assert len(ServerScenario(10.0, 100.0, 1, max_query_count=12).arrival_times()) == 12


def test_offline_all_at_zero_every_sample_once():
    sched = OfflineScenario(num_queries=10, seed=1).schedule(10)
    assert {q.scheduled_s for q in sched} == {0.0}
    assert sorted(q.sample_index for q in sched) == list(range(10))


def test_sample_order_uses_every_sample_before_repeating():
    order = sample_order(5, 12, seed=0)
    assert sorted(order[:5]) == list(range(5)) and sorted(order[5:10]) == list(range(5))


def test_bad_arguments():
    with pytest.raises(ValueError, match="target_qps"):
        ServerScenario(0.0, 1.0, 1)
    with pytest.raises(ValueError, match="concurrency"):
        ConcurrencyScenario(0, 3)
