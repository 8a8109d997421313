"""The step-time model: features of a step, the online fit, its prior, and chunk sizing."""
from __future__ import annotations

import random

import pytest

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.core.policy import StepBudget
from tokenmill.core.step_time import (PER_OP, DecodeRows, StepFeatures, StepTimeModel, chunk_features, server_bound,
                                      step_features)
from tokenmill.sampling_params import SamplingParams

COSTS = {"intercept": 0.012, "per_decode_row": 0.004, "per_prefill_token": 0.0015, "per_context_read": 2e-7,
         "per_prefill_step": 0.003, "per_mixed_step": 0.002}


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
    assert per_op.chunk_marginal(50, 5) == pytest.approx(5 * COSTS["per_prefill_token"] + 265 * 2e-7
                                                         + COSTS["per_prefill_step"])
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
        assert model.predict(f) == pytest.approx(truth.predict(f), rel=0.03, abs=0.003)   # 5% noise, 6 terms


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


def test_a_step_with_prefill_tokens_pays_the_per_step_prefill_costs_once():
    """Features: 1 prefill step for any prefill tokens, 1 mixed step where decode rows run beside them (a
    forecast's mean step may give a fraction). A chunk's marginal time is what it adds to the work a step
    has: the step's first prefill chunk adds per_prefill_step, and per_mixed_step beside decode rows, a later
    one only its tokens; decode rows alone pay neither, a first decode row beside prefill pays
    per_mixed_step. A budget charges grants so, and a rollback gives back what the grants since its
    checkpoint added."""
    assert StepFeatures(3, 0, 10).values()[4:] == (0.0, 0.0) and StepFeatures(3, 2, 10).values()[4:] == (1.0, 1.0)
    assert StepFeatures(0, 2, 10).values()[4:] == (1.0, 0.0)
    assert StepFeatures(3, 2, 10, prefill_steps=0.25).values()[4:] == (0.25, 0.25)
    assert step_features(SchedulerOutput([_sr(9, 1), _sr(0, 4)])).prefill_steps == 1.0
    model, c = StepTimeModel(prior=COSTS), COSTS
    tokens_only = 20 * c["per_prefill_token"] + (20 * 100 + 210) * c["per_context_read"]
    decodes = StepFeatures(8, 0, 800)
    assert model.chunk_marginal(100, 20) == pytest.approx(tokens_only + c["per_prefill_step"])
    assert model.chunk_marginal(100, 20, decodes) == pytest.approx(
        tokens_only + c["per_prefill_step"] + c["per_mixed_step"])
    assert model.chunk_marginal(100, 20, decodes.plus(StepFeatures(0, 5, 15))) == pytest.approx(tokens_only)
    one_row = c["per_decode_row"] + 101 * c["per_context_read"]
    assert model.chunk_marginal(100, 1, decodes) == pytest.approx(one_row)
    assert model.chunk_marginal(100, 1, StepFeatures(0, 5, 15)) == pytest.approx(one_row + c["per_mixed_step"])
    fused = StepTimeModel(prior=COSTS, rows=DecodeRows(17, 64))
    assert fused.chunk_marginal(100, 5, decodes) == pytest.approx(5 * c["per_decode_row"] + 515 * c["per_context_read"])
    # the largest chunk that fits, with and without the per-step costs still to pay
    assert model.max_chunk(0, 1000, 0.02, decodes) < model.max_chunk(0, 1000, 0.02, StepFeatures(8, 5, 815))
    budget = StepBudget(tokens=1000, allowance_s=1.0, model=model)
    assert budget.grant(99, 1) == 1 and budget.step == StepFeatures(1, 0, 100)
    checkpoint = budget.checkpoint()
    assert budget.grant(0, 40) == 40 and budget.grant(0, 30) == 30
    spent = model.predict(StepFeatures(1, 70, 100 + 820 + 465)) - model.predict(StepFeatures())
    assert budget.seconds == pytest.approx(1.0 - spent)
    budget.rollback(checkpoint)
    assert budget.step == StepFeatures(1, 0, 100) and budget.tokens == 999 and not budget.prefill_granted
    assert budget.seconds == pytest.approx(1.0 - model.chunk_marginal(99, 1))


def test_a_rolled_back_prefill_chunk_leaves_no_trace_on_later_grants():
    """A chunk granted past the time left (the step's minimum chunk) and then rolled back (its request found
    no KV blocks): the next prompt still gets the minimum chunk, and the drafts get what they would have had
    without it, not its overdraft as well."""
    model = StepTimeModel(prior=COSTS)
    def budget() -> StepBudget:
        b = StepBudget(tokens=1000, allowance_s=model.chunk_marginal(99, 1) + 0.02, model=model,
                       min_prefill_chunk=16)
        assert b.grant(99, 1) == 1                          # a decode row
        return b
    untouched, rolled_back = budget(), budget()
    checkpoint = rolled_back.checkpoint()
    assert rolled_back.grant(0, 400) == 16 and rolled_back.prefill_granted     # 16 tokens past the time left
    rolled_back.rollback(checkpoint)
    assert rolled_back.grant_drafts(99, 100) == untouched.grant_drafts(99, 100) > 0
    assert rolled_back.grant(0, 400) == untouched.grant(0, 400) == 16


def test_the_fit_tells_the_per_step_costs_from_the_per_token_one():
    """Prefill steps of 8 to 512 tokens, alone and beside decode batches (the calibration's shapes),
    separate per_prefill_step and per_mixed_step from the per-token and per-row costs, so a small piece is
    priced as what it costs. (decay 1: the calibration's fit, every step counted alike.)"""
    rng, truth, model = random.Random(3), StepTimeModel(prior=COSTS), StepTimeModel(decay=1.0)
    for _ in range(300):
        rows = 0 if rng.random() < 0.3 else rng.randrange(1, 24)     # prefill alone, or beside decodes
        prefill = rng.choice([0, 0, 0, 8, 16, 32, 128, 512])
        f = StepFeatures(rows, prefill, rows * 100 + prefill * prefill // 2)
        model.observe(f, truth.predict(f) * rng.uniform(0.98, 1.02))
    assert model.coefficients["per_prefill_step"] == pytest.approx(COSTS["per_prefill_step"], rel=0.25)
    assert model.coefficients["per_mixed_step"] == pytest.approx(COSTS["per_mixed_step"], rel=0.25)
    decodes = StepFeatures(12, 0, 1200)
    assert model.chunk_marginal(0, 16, decodes) == pytest.approx(truth.chunk_marginal(0, 16, decodes), rel=0.1)


@pytest.mark.parametrize("prompt_len, output_len", [(16, 4), (128, 512)])
def test_the_server_bound_fills_the_tpot_limit_with_its_steady_step(prompt_len, output_len):
    """server_bound's N rows: intercept + k * N + (per_prefill_step + per_mixed_step) * f = the limit,
    f = min(1, N / output_len) (a short output: every step carries a prompt; a long one: a fraction of steps
    does)."""
    model, c, p, d, limit = StepTimeModel(prior=COSTS), COSTS, prompt_len, output_len, 0.1
    bound = server_bound(model, p, d, limit)
    n = bound["rows"]
    k = c["per_decode_row"] + c["per_prefill_token"] * p / d + c["per_context_read"] * (p + d / 2 + (p / d) * p / 2)
    per_step = c["per_prefill_step"] + c["per_mixed_step"]
    assert c["intercept"] + k * n + per_step * min(1.0, n / d) == pytest.approx(limit)
    assert bound["tokens_per_s"] == pytest.approx(n / limit)
    assert (n >= d) == (output_len == 4)


def test_a_few_outlying_mixed_steps_do_not_move_the_per_step_costs_far():
    """An Offline-like run: hundreds of decode steps and three large mixed steps the linear terms misprice
    by 60 ms. The per-step costs' prior counts as 64 steps carrying them, so those three steps move
    per_mixed_step by about 3/67 of their residual, not the whole of it (as a pull of 4 average steps would)."""
    def fit(**kw):
        model, truth = StepTimeModel(prior=COSTS, **kw), StepTimeModel(prior=COSTS)
        for i in range(300):
            f = StepFeatures(100, 0, 8000) if i % 100 else StepFeatures(60, 1900, 60000)
            model.observe(f, truth.predict(f) + (0.060 if f.prefill_tokens else 0.0))
        return model.coefficients["per_mixed_step"] + model.coefficients["per_prefill_step"]
    held = fit()
    assert held < COSTS["per_mixed_step"] + COSTS["per_prefill_step"] + 0.006
    assert fit(step_cost_prior_weight=0.2) > held + 0.01
