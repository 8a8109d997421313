"""bench/queueing.py, the share of the step-time bound a capped batch serves within a TTFT limit under Poisson
arrivals: its engine model against the real scheduler (tests/core/slo_sim.py: FCFS at max_num_seqs = the
cap, on the same arrivals and step costs), and the ceiling's scale."""
from __future__ import annotations

import random

import numpy as np
import pytest

from .slo_sim import Arrival, simulate
from tokenmill.bench.queueing import (bound_ceiling, capped_fcfs_ttfts, server_arrivals, step_seconds,
                                      utilization_ceiling)
from tokenmill.core.step_time import StepFeatures, StepTimeModel, server_bound

# int4 on this project's CPUs at a 100 ms TPOT limit, 128 -> 128 tokens: about 48 rows a step
CPU_COSTS = {"intercept": 0.0068, "per_decode_row": 0.00104, "per_prefill_token": 0.0005, "per_context_read": 1.3e-6,
             "per_prefill_step": 0.0025, "per_mixed_step": 0.0022}


def test_step_seconds_is_the_step_time_models_prediction():
    rng = random.Random(0)
    model = StepTimeModel(prior=CPU_COSTS)
    for _ in range(50):
        rows, prefill, reads = rng.randrange(0, 64), rng.choice([0, rng.randrange(1, 4096)]), rng.randrange(0, 10**6)
        assert step_seconds(CPU_COSTS, rows, prefill, reads) == \
            pytest.approx(model.predict(StepFeatures(rows, prefill, reads)), rel=1e-9)


@pytest.mark.parametrize("prompt_len, budget, rate", [(32, 2048, 6.5), (100, 256, 6.5), (100, 150, 3.0)])
def test_the_model_gives_the_schedulers_ttfts_on_the_same_arrivals(prompt_len, budget, rate):
    """Arrivals for a batch capped at 6 requests of 64 output tokens: the real scheduler (FCFS, max_num_seqs
    6) on a fake model with these step costs gives every request the TTFT the model computes, exactly where
    whole prompts fit the token budget (at 6.5/s a queue forms: TTFTs past a second). With a 150-token budget
    a second 100-token prompt fits only in part: the scheduler starts it in a chunk where the model waits a
    step for it, and the TTFTs differ by less than a step's worth either way."""
    arrivals = server_arrivals(rate, 30.0, seed=3)
    model_ttfts = capped_fcfs_ttfts(CPU_COSTS, 6, prompt_len, 64, arrivals, max_num_batched_tokens=budget)
    sim = simulate([Arrival(float(t), prompt_len, 64) for t in arrivals], "fcfs", max_num_seqs=6, budget=budget,
                   prior=CPU_COSTS, costs=CPU_COSTS)
    sim_ttfts = np.array([sim.ttft_s[f"r{i}"] for i in range(arrivals.size)])
    assert arrivals.size > 60
    if budget >= 256:
        assert model_ttfts.max() > 1.0                                   # the queue formed
        np.testing.assert_allclose(model_ttfts, sim_ttfts, rtol=1e-9, atol=1e-9)
    else:
        assert 0 < np.abs(model_ttfts - sim_ttfts).max() < 0.05
        assert abs(np.quantile(model_ttfts, 0.99) - np.quantile(sim_ttfts, 0.99)) < 0.05


def test_a_batch_that_holds_more_rows_absorbs_more_of_a_burst():
    """The same TTFT limit and run length: a platform whose step holds about 48 rows within a 100 ms TPOT
    (a CPU) serves a Poisson load within a 2 s p99 TTFT only well below its bound; one whose step holds
    about 1,000 rows (per-row cost 50x smaller) comes near it. MLPerf's 600 s runs: in shorter ones fewer
    bursts reach the tail."""
    gpu_costs = {**CPU_COSTS, "per_decode_row": CPU_COSTS["per_decode_row"] / 50,
                 "per_prefill_token": CPU_COSTS["per_prefill_token"] / 50, "per_context_read": 1e-8}
    ceilings = {}
    for name, costs in (("cpu", CPU_COSTS), ("gpu", gpu_costs)):
        bound = server_bound(StepTimeModel(prior=costs), 128, 128, 0.1)
        ceiling = bound_ceiling(costs, bound, 2000.0)
        assert ceiling["rows"] == int(bound["rows"])
        ceilings[name] = ceiling["utilization"]
    assert 0.5 < ceilings["cpu"] < 0.93 < 0.97 < ceilings["gpu"]


def test_the_ceiling_is_where_the_median_run_meets_the_limit():
    """Just below the ceiling the median run's p99 TTFT is within the limit, just above it is not."""
    bound = server_bound(StepTimeModel(prior=CPU_COSTS), 128, 128, 0.1)
    rate, rows = bound["tokens_per_s"] / 128, int(bound["rows"])
    rho = utilization_ceiling(CPU_COSTS, rows, 128, 128, rate, 2.0, duration_s=120.0, runs=5, tolerance=0.01)

    def median_p99(r: float) -> float:
        return float(np.median([np.quantile(capped_fcfs_ttfts(CPU_COSTS, rows, 128, 128,
                                                              server_arrivals(r * rate, 120.0, seed)),
                                            0.99, method="inverted_cdf") for seed in range(5)]))

    assert 0.0 < rho < 1.0
    assert median_p99(rho) <= 2.0 < median_p99(rho + 0.01)


def test_a_limit_no_load_meets_gives_zero_and_a_bound_without_rows_or_limit_none():
    """No load meets a 10 ms TTFT: 0. No TTFT limit, no whole row, rows that cost nothing (an infinite
    bound), or a bound too fast to simulate: no ceiling."""
    bound = server_bound(StepTimeModel(prior=CPU_COSTS), 128, 128, 0.1)
    assert utilization_ceiling(CPU_COSTS, 48, 128, 128, 3.0, ttft_limit_s=0.01, duration_s=60.0, runs=3) == 0.0
    assert bound_ceiling(CPU_COSTS, bound, None) is None
    assert bound_ceiling(CPU_COSTS, {**bound, "rows": 0.5}, 2000.0) is None
    free_rows = server_bound(StepTimeModel(prior={"intercept": 0.01}), 128, 128, 0.1)    # rows cost nothing
    assert free_rows["rows"] == float("inf") and bound_ceiling({"intercept": 0.01}, free_rows, 2000.0) is None
    assert bound_ceiling(CPU_COSTS, {**bound, "tokens_per_s": 1e8}, 2000.0) is None        # too many to simulate


@pytest.mark.parametrize("kw", [{"rows": 0}, {"bound_rate": 0.0}, {"ttft_limit_s": -1.0}, {"runs": 0}])
def test_bad_settings_are_named(kw):
    args = {"coefficients": CPU_COSTS, "rows": 48, "prompt_len": 128, "output_len": 128, "bound_rate": 3.0,
            "ttft_limit_s": 2.0, **kw}
    with pytest.raises(ValueError, match="utilization_ceiling: need rows >= 1"):
        utilization_ceiling(**args)


def test_the_same_seed_draws_the_same_arrivals_at_every_rate():
    slow, fast = server_arrivals(2.0, 100.0, seed=7), server_arrivals(4.0, 100.0, seed=7)
    np.testing.assert_allclose(fast[:slow.size // 2], slow[:slow.size // 2] / 2)
