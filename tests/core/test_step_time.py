"""The step-time model: features of a step, the online fit, its prior, and chunk sizing."""
from __future__ import annotations

import random

import pytest

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import StepFeatures, StepTimeModel, chunk_features, step_features
from tokenmill.sampling_params import SamplingParams

COSTS = {"intercept": 0.012, "per_decode_row": 0.004, "per_prefill_token": 0.0015, "per_context_read": 2e-7}


def _sr(start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest("r", [1] * n, start, [0], True, SamplingParams(), [], [], ())


def test_features_count_decode_rows_prefill_tokens_and_attention_reads():
    out = SchedulerOutput([_sr(99, 1), _sr(10, 1), _sr(0, 4), _sr(8, 3)])
    f = step_features(out)
    assert f == StepFeatures(decode_rows=2, prefill_tokens=7, context_reads=100 + 11 + (1 + 2 + 3 + 4) + (9 + 10 + 11))
    assert chunk_features(5, 1) == StepFeatures(1, 0, 6)


def _shapes(rng):
    for _ in range(400):
        rows, prefill = rng.randrange(0, 40), rng.choice([0, 0, 16, 64, 256])
        yield StepFeatures(rows, prefill, rows * rng.randrange(16, 600) + prefill * prefill // 2)


def test_the_fit_recovers_the_coefficients_from_noisy_steps():
    rng, truth, model = random.Random(0), StepTimeModel(prior=COSTS), StepTimeModel()
    assert not model.is_fitted
    for f in _shapes(rng):
        model.observe(f, truth.predict(f) * rng.uniform(0.95, 1.05))
    assert model.is_fitted
    for name in ("intercept", "per_decode_row", "per_prefill_token"):   # reads are a small part of a step
        assert model.coefficients[name] == pytest.approx(COSTS[name], rel=0.1), name
    for f in _shapes(random.Random(2)):
        assert model.predict(f) == pytest.approx(truth.predict(f), rel=0.03, abs=0.002)


def test_recent_steps_outweigh_old_ones_when_the_machine_changes():
    rng, model = random.Random(1), StepTimeModel()
    before, after = StepTimeModel(prior=COSTS), StepTimeModel(prior={k: 2 * v for k, v in COSTS.items()})
    for f in _shapes(rng):
        model.observe(f, before.predict(f))
    for _ in range(3):                                 # 1,200 steps: the old ones keep 0.995^1200 of their weight
        for f in _shapes(rng):
            model.observe(f, after.predict(f))
    probe = StepFeatures(16, 64, 5000)
    assert model.predict(probe) == pytest.approx(after.predict(probe), rel=0.05)


def test_the_prior_stands_where_the_data_say_nothing():
    model = StepTimeModel(prior=COSTS)
    for rows in range(1, 30):                          # decodes only: nothing about prefill tokens
        f = StepFeatures(rows, 0, rows * 200)
        model.observe(f, StepTimeModel(prior=COSTS).predict(f))
    assert model.coefficients["per_prefill_token"] == pytest.approx(COSTS["per_prefill_token"], rel=1e-6)


def test_coefficients_stay_non_negative():
    model = StepTimeModel()
    for rows in range(1, 50):                          # time falls with rows: the fit clamps at zero
        model.observe(StepFeatures(rows, 0, 0), 0.1 - 0.001 * rows)
    assert all(v >= 0 for v in model.coefficients.values())
    assert model.predict(StepFeatures(10, 0, 0)) > 0


def test_max_chunk_is_the_largest_chunk_whose_marginal_time_fits():
    model = StepTimeModel(prior=COSTS)
    n = model.max_chunk(start_position=100, remaining=1000, seconds=0.05)
    assert model.marginal(chunk_features(100, n)) <= 0.05 < model.marginal(chunk_features(100, n + 1))
    assert model.max_chunk(0, 5, 10.0) == 5 and model.max_chunk(0, 5, 0.0) == 0


def test_bad_observations_are_ignored():
    model = StepTimeModel(prior=COSTS)
    model.observe(StepFeatures(1, 0, 0), float("nan"))
    model.observe(StepFeatures(1, 0, 0), -1.0)
    assert model.num_observations == 0
