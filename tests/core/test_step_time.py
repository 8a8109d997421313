"""The step-time model: features of a step, the online fit, its prior, and chunk sizing."""
from __future__ import annotations

import random

import pytest

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.core.step_time import PER_OP, DecodeRows, StepFeatures, StepTimeModel, chunk_features, step_features
from tokenmill.sampling_params import SamplingParams

COSTS = {"intercept": 0.012, "per_decode_row": 0.004, "per_prefill_token": 0.0015, "per_context_read": 2e-7}


def _sr(start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest("r", [1] * n, start, [0], True, SamplingParams(), [], [], ())


def test_features_count_decode_rows_prefill_tokens_and_attention_reads():
    out = SchedulerOutput([_sr(99, 1), _sr(10, 1), _sr(0, 4), _sr(8, 3)])
    f = step_features(out)
    assert f == StepFeatures(decode_rows=2, prefill_tokens=7, context_reads=100 + 11 + (1 + 2 + 3 + 4) + (9 + 10 + 11))
    assert chunk_features(5, 1) == StepFeatures(1, 0, 6)


def test_verify_tokens_are_decode_rows_only_in_steps_the_fused_program_takes():
    """Under DecodeRows(17, 8) a step of decodes and verifies (<= 17 tokens each, after a cached context,
    <= 8 rows) is all decode rows; a prefill (start 0), an 18-token chunk or a 9th row sends the whole step
    per op, where only single tokens are rows. PER_OP never makes a verify rows."""
    fused = DecodeRows(max_query_len=17, max_rows=8)
    verify = SchedulerOutput([_sr(40, 1), _sr(20, 5)])
    reads = 41 + 5 * 20 + 15
    assert step_features(verify, fused) == StepFeatures(6, 0, reads)
    assert step_features(verify) == step_features(verify, PER_OP) == StepFeatures(1, 5, reads)
    with_prefill = SchedulerOutput([_sr(40, 1), _sr(20, 5), _sr(0, 3)])
    assert step_features(with_prefill, fused) == StepFeatures(1, 8, reads + 6)
    too_long = SchedulerOutput([_sr(40, 1), _sr(20, 18)])
    assert step_features(too_long, fused).prefill_tokens == 18
    too_many = SchedulerOutput([_sr(40, 1), _sr(20, 5), _sr(30, 3)])
    assert step_features(too_many, fused) == StepFeatures(1, 8, reads + 3 * 30 + 6)
    assert step_features(SchedulerOutput([_sr(9, 1), _sr(3, 1)]), fused) == StepFeatures(2, 0, 14)
    one_token_prompt = SchedulerOutput([_sr(0, 1), _sr(20, 5)])       # its first chunk: a prefill step
    assert step_features(one_token_prompt, fused) == StepFeatures(1, 5, 1 + 115)
    assert chunk_features(20, 5, fused) == StepFeatures(5, 0, 115)
    assert chunk_features(0, 5, fused) == StepFeatures(0, 5, 15)
    assert chunk_features(20, 18, fused) == StepFeatures(0, 18, 18 * 20 + 171)


def test_a_model_prices_chunks_under_its_decode_rows():
    per_op, fused = StepTimeModel(prior=COSTS), StepTimeModel(prior=COSTS, rows=DecodeRows(17, 64))
    assert fused.chunk_marginal(50, 5) == pytest.approx(5 * COSTS["per_decode_row"] + 265 * 2e-7)
    assert per_op.chunk_marginal(50, 5) == pytest.approx(5 * COSTS["per_prefill_token"] + 265 * 2e-7)
    assert fused.step_features(SchedulerOutput([_sr(50, 5)])) == StepFeatures(5, 0, 265)
    assert fused.describe()["decode_rows"] == {"max_query_len": 17, "max_rows": 64}


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
