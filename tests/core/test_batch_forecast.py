"""The admission forecast: the batch over the coming steps, and the arrival rate it assumes."""
from __future__ import annotations

import random

import pytest

from tokenmill.core.batch_forecast import ArrivalRate, BatchForecast


def _naive_batch_sum(remaining, new_per_step, mean_output, steps):
    return sum(sum(1 for r in remaining if r >= j) + new_per_step * min(j, mean_output) for j in range(1, steps + 1))


@pytest.mark.parametrize("seed", range(5))
def test_batch_sum_is_the_sum_of_the_batch_step_by_step(seed):
    rng = random.Random(seed)
    remaining = tuple(rng.randrange(1, 200) for _ in range(rng.randrange(1, 40)))
    f = BatchForecast(remaining, rng.uniform(0, 0.3), rng.uniform(1, 150), 0.05, 0.003)
    for steps in (1, 7, 64, 150, 400):
        assert f.batch_sum(steps) == pytest.approx(_naive_batch_sum(remaining, f.new_per_step, f.mean_output, steps))
        assert f.time_s(steps) == pytest.approx(steps * 0.05 + 0.003 * f.batch_sum(steps))


def test_a_batch_that_drains_costs_less_per_step_than_one_that_stays():
    draining = BatchForecast((10,) * 8, 0.0, 100, 0.05, 0.003)
    staying = BatchForecast((100,) * 8, 0.0, 100, 0.05, 0.003)
    assert draining.mean_step_s(100) < staying.mean_step_s(100) == pytest.approx(0.05 + 8 * 0.003)


def test_arrival_rate_over_a_window_and_a_burst_is_not_a_rate():
    rate = ArrivalRate(window_s=60.0, min_span_s=10.0)
    assert rate.rate(0.0) == 0.0
    for i in range(31):
        rate.add(i * 2.0)                       # 0.5 per second for a minute
    assert rate.rate(60.0) == pytest.approx(0.5)
    assert rate.rate(200.0) == 0.0              # all outside the window
    burst = ArrivalRate(min_span_s=10.0)
    for _ in range(40):
        burst.add(5.0)
    assert burst.rate(5.0) == pytest.approx(3.9)   # 39 gaps over the 10 s minimum span, not infinity
