"""What a step computes and yields per decoding request (core/decode_yield.py), as the scheduler measures it,
and the SLO policy's forecasts read through it."""
from __future__ import annotations

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.core.batch_forecast import BatchForecast
from tokenmill.core.decode_yield import PLAIN, DecodeYield, DecodeYieldMeter
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.messages import RunnerOutput
from tokenmill.core.policy import make_policy
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.slo_policy import SLOPolicy
from tokenmill.core.step_time import DecodeRows, StepFeatures, StepTimeModel
from tokenmill.sampling_params import SamplingParams

COSTS = {"intercept": 0.010, "per_decode_row": 0.004, "per_prefill_token": 0.001, "per_context_read": 1e-7}


def test_plain_is_one_decode_row_and_one_output_token_a_step():
    assert PLAIN.features(3, 30) == StepFeatures(3, 0, 33)       # each new token reads its position + 1
    assert PLAIN.steps_for(7) == 7 and PLAIN.steps_for(0) == 0
    assert DecodeYieldMeter().current == PLAIN                   # nothing measured yet


def test_the_meter_averages_what_decoding_requests_computed_and_yielded():
    fused = StepTimeModel(rows=DecodeRows(max_query_len=8, max_rows=64))
    meter = DecodeYieldMeter(decay=1.0)
    meter.record(fused.chunk_features(10, 5), 3)                 # 1 + 4 drafts as rows, 2 accepted
    meter.record(fused.chunk_features(20, 1), 1)                 # no drafts this step
    y = meter.current
    assert (y.decode_rows, y.prefill_tokens, y.self_reads, y.output_tokens) == (3.0, 0.0, 8.0, 2.0)
    assert y.steps_for(5) == 3                                   # 5 more tokens at 2 a step
    per_op = DecodeYieldMeter(decay=1.0)
    per_op.record(StepTimeModel().chunk_features(10, 5), 3)     # a verify chunk run per op: prefill tokens
    assert (per_op.current.decode_rows, per_op.current.prefill_tokens) == (0.0, 5.0)
    # 2 requests at positions summing to 40, 5 new tokens each: 5 * 40 + 2 * 15 reads
    assert per_op.current.features(2, 40) == StepFeatures(0, 10, 230)


def _scheduler() -> Scheduler:
    s = Scheduler(SchedulerConfig(8, 256, max_model_len=512), KVCacheManager(64, 4, False), make_policy("slo"),
                  StepTimeModel(prior=COSTS), clock=lambda: 0.0)
    s.decode_yield = DecodeYieldMeter(decay=1.0)
    return s


def _step(s: Scheduler, sampled: dict[str, list[int]]):
    out = s.schedule()
    s.update(out, RunnerOutput({sr.request_id: sampled[sr.request_id] for sr in out.scheduled if sr.sample}))
    return out


def test_the_scheduler_measures_decoding_requests_only_with_their_drafts():
    s = _scheduler()
    s.add_request(Request("a", [3] * 6, SamplingParams(max_tokens=32, ignore_eos=True), arrival_time=0.0))
    _step(s, {"a": [5]})                                         # the prefill: not a decode step
    assert s.decode_yield.current == PLAIN
    s.running[0].spec_token_ids = [5, 5, 5]
    out = _step(s, {"a": [5, 5, 7]})                             # 2 of 3 drafts accepted, then its own token
    assert out.scheduled[0].num_new_tokens == 4
    y = s.decode_yield.current
    assert (y.decode_rows, y.prefill_tokens, y.output_tokens) == (0.0, 4.0, 3.0)   # per op: a chunk of 4
    _step(s, {"a": [5]})                                         # a plain decode (no drafts proposed)
    y = s.decode_yield.current
    assert (y.decode_rows, y.prefill_tokens, y.output_tokens) == (0.5, 2.0, 2.0)


def _decoding_request(rid: str, produced: int, first_token_time: float) -> Request:
    r = Request(rid, [3] * 16, SamplingParams(max_tokens=64, min_tokens=64, ignore_eos=True,
                                               tpot_target_ms=50.0), arrival_time=0.0)
    r.all_token_ids += [5] * produced
    r.num_computed_tokens = r.num_tokens - 1
    r.first_token_time = first_token_time
    return r


def test_forecasts_divide_step_time_by_the_yield_and_price_the_steps_by_what_they_compute():
    policy, model = SLOPolicy(), StepTimeModel(prior=COSTS)
    batch = [_decoding_request(f"r{i}", 4, 0.0) for i in range(4)]
    verify = DecodeYield(decode_rows=0.0, prefill_tokens=4.0, self_reads=10.0, output_tokens=2.5)
    # a step of 4 verify chunks of 4 tokens costs 16 prefill tokens, besides the batch's prefill share
    plain_steady, spec_steady = policy.steady_step_s(batch, model), policy.steady_step_s(batch, model, verify)
    assert spec_steady - plain_steady == pytest.approx(
        16 * COSTS["per_prefill_token"] - 4 * COSTS["per_decode_row"], abs=2 * COSTS["per_prefill_token"])
    forecast = policy.forecast(batch, model, 0.0, verify)
    assert forecast.remaining == (24,) * 4                       # 60 tokens left each, 2.5 a step
    # before its first token, a request's TPOT is the mean step over what a step yields
    fresh = _decoding_request("new", 0, None)
    assert policy.projected_tpot_s(fresh, forecast, 0.0) == pytest.approx(forecast.mean_step_s(26) / 2.5)   # 64 tokens
    # after it: time so far plus its remaining steps, over its tokens after the first
    r = batch[0]
    assert policy.projected_tpot_s(r, forecast, 0.1) == pytest.approx((0.1 + forecast.time_s(24)) / (3 + 60))


def test_the_step_limit_spreads_a_requests_slack_over_its_steps_not_its_tokens():
    policy, model = SLOPolicy(), StepTimeModel(prior=COSTS)
    batch = [_decoding_request("r", 4, 0.0)]
    y = DecodeYield(decode_rows=0.0, prefill_tokens=4.0, self_reads=10.0, output_tokens=2.0)
    c = policy.config
    h = min(60, c.horizon_steps * 2)          # its remaining tokens, at most horizon_steps steps' yield
    steady = policy.steady_step_s(batch, model, y)
    allowance = c.tpot_margin * 0.050 * (3 + h)
    expected = steady + c.slack_spend * (allowance - steady * h / 2)
    assert policy.step_limit_s(batch, 0.0, model, y) == pytest.approx(expected)


def test_a_batch_forecast_without_a_yield_is_plain():
    assert BatchForecast((3, 1), 0.0, 2.0, 0.01, 0.002).decode_yield == PLAIN


def test_drafts_that_do_not_pay_are_planned_as_plain_steps():
    policy, model = SLOPolicy(), StepTimeModel(prior=COSTS)
    batch = [_decoding_request(f"r{i}", 4, 0.0) for i in range(4)]
    paying = DecodeYield(decode_rows=5.0, prefill_tokens=0.0, self_reads=15.0, output_tokens=3.5)
    losing = DecodeYield(decode_rows=5.0, prefill_tokens=0.0, self_reads=15.0, output_tokens=1.2)
    assert policy.plan_yield(batch, model, paying) == (paying, policy.steady_step_s(batch, model, paying))
    assert policy.plan_yield(batch, model, losing) == (PLAIN, policy.steady_step_s(batch, model))   # 5 rows, 1.2 tokens
    assert policy.step_limit_s(batch, 0.0, model, losing) == policy.step_limit_s(batch, 0.0, model)
    assert policy.forecast(batch, model, 0.0, losing) == policy.forecast(batch, model, 0.0)


def test_request_steps_whose_drafts_the_budget_withheld_are_not_measured():
    """The meter measures the yield of drafting as proposed: a request granted fewer drafts than it brought
    (the step's budget or the pool withheld them) is left out, and the step says how many were cut (the
    engine's adaptive draft length then ignores it too)."""
    s = Scheduler(SchedulerConfig(8, 5, max_model_len=512), KVCacheManager(64, 4, False), make_policy("slo"),
                  StepTimeModel(prior=COSTS), clock=lambda: 0.0)     # 5 tokens a step
    s.decode_yield = DecodeYieldMeter(decay=1.0)
    for rid in ("a", "b"):
        s.add_request(Request(rid, [3] * 2, SamplingParams(max_tokens=32, ignore_eos=True), arrival_time=0.0))
    _step(s, {"a": [5], "b": [5]})
    for r in s.running:
        r.spec_token_ids = [5, 5]
    out = _step(s, {"a": [5, 5, 7], "b": [5]})                  # a: 1 + 2 drafts; b: 1 + 1 of its 2
    assert [sr.num_draft_tokens for sr in out.scheduled] == [2, 1]
    assert out.num_requests_drafts_withheld == 1 and s.drafts_withheld == {"b"}
    y = s.decode_yield.current
    assert (y.prefill_tokens, y.output_tokens) == (3.0, 3.0)      # a alone: a chunk of 3, 3 tokens


def _decoding_with_drafts(s: Scheduler, n: int) -> None:
    """n decoding requests (their first token at 0 s, 60 tokens left, 50 ms TPOT targets), each bringing 4
    drafts."""
    for i in range(n):
        r = _decoding_request(f"r{i}", 4, 0.0)
        r.spec_token_ids = [5] * 4
        s.add_request(r)
        s.waiting.remove(r)
        s.kv.allocate_slots(r, r.num_tokens)
        r.status = RequestStatus.RUNNING
        s.running.append(r)


def test_a_step_limit_at_its_floor_keeps_the_drafts_that_pay():
    """On a platform that verifies drafts as decode rows, 4 drafts a step yielding 3 tokens take less time
    per output token than plain decodes. Requests behind their steady steps but still within reach of
    decode-only steps put the step limit at its floor: that is the decode-only step with the drafts
    (cutting them would lengthen every TPOT), and a waiting prompt gets only the minimum chunk of it, the
    drafts the rest."""
    rows, costs = DecodeRows(max_query_len=8, max_rows=64), {**COSTS, "intercept": 0.004, "per_decode_row": 0.0002}
    clock = [0.0]
    s = Scheduler(SchedulerConfig(8, 256, max_model_len=512), KVCacheManager(64, 16, False), make_policy("slo"),
                  StepTimeModel(prior=costs, rows=rows), clock=lambda: clock[0])
    s.decode_yield = DecodeYieldMeter(decay=1.0)
    s.decode_yield.record(s.step_model.chunk_features(20, 5), 3)
    _decoding_with_drafts(s, 4)
    policy, model, y = s.policy, s.step_model, s.decode_yield.current
    plain = model.predict(SLOPolicy._decode_only_step(s.running))
    drafted = model.predict(y.features(4, sum(r.num_tokens - 1 for r in s.running)))
    assert drafted / 3 < plain < drafted                         # the drafts pay per output token
    # elapsed so that each request's allowance for its 60 tokens is just above 60 decode-only drafted tokens
    clock[0] = policy.config.tpot_margin * 0.050 * 63 - 1.01 * 60 * drafted / 3
    assert policy.step_limit_s(s.running, clock[0], model, y) == pytest.approx(drafted)
    s.add_request(Request("p", [9] * 100, SamplingParams(max_tokens=8, ttft_target_ms=60_000.0),
                          arrival_time=clock[0]))
    out = s.schedule()
    assert {sr.request_id: sr.num_draft_tokens for sr in out.scheduled if sr.request_id != "p"} == \
        {f"r{i}": 4 for i in range(4)}
    assert {sr.request_id: sr.num_new_tokens for sr in out.scheduled}["p"] == policy.config.min_prefill_chunk
