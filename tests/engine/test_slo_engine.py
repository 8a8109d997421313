"""The SLO policy in the real engine (tiny random model): the start-up calibration and its cache, the step-time
model exposed, and tokens identical to FCFS's (scheduling changes when, never what)."""
from __future__ import annotations

import json
import os

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine import calibration


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_calibration_runs_once_per_machine_and_model_then_comes_from_the_cache(tiny_model_dir, cache_dir):
    llm = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20)
    info = llm.engine.step_time_model()
    assert info["source"] == "calibrated" and info["policy"] == "slo"
    assert info["intercept_ms"] > 0 and info["per_decode_row_ms"] + info["per_prefill_token_ms"] > 0
    files = os.listdir(cache_dir / "step-time")
    assert len(files) == 1
    saved = json.loads((cache_dir / "step-time" / files[0]).read_text())["coefficients"]
    assert saved == pytest.approx(info["prior"])
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_used_blocks == 0
    again = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20)
    assert again.engine.step_time_model()["source"] == "cache"
    assert again.engine.step_time_model()["prior"] == pytest.approx(saved)
    other = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20, block_size=8)
    assert other.engine.step_time_model()["source"] == "calibrated"      # a different setting, its own entry


def test_the_calibrations_requests_are_no_load_for_the_policy(tiny_model_dir, cache_dir):
    """The calibration's synthetic requests pass through the SLO policy but leave its arrival rate (the
    admission forecast's coming load) and its output lengths as they were: empty."""
    import time
    llm = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20)
    assert llm.engine.step_time_model()["source"] == "calibrated"
    policy = llm.engine.core.scheduler.policy
    assert not policy.arrivals.times and policy.arrivals.rate(time.perf_counter()) == 0.0
    assert not policy.lengths.records


def test_fcfs_engines_skip_calibration_but_still_fit_online(tiny_model_dir, cache_dir):
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20)
    assert llm.engine.step_time_model()["source"] == "online"
    llm.generate(["a b c"] * 4, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    assert llm.engine.step_time_model()["observations"] >= 6
    assert not (cache_dir / "step-time").exists()


def test_slo_policy_generates_exactly_fcfs_tokens(tiny_model_dir, cache_dir):
    prompts = [f"prompt number {i} " * (1 + i % 5) for i in range(12)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0, ttft_target_ms=1.0, tpot_target_ms=1.0)
    fcfs = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20).generate(prompts, params)
    slo = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=64).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in slo] == [o.outputs[0].token_ids for o in fcfs]


def test_an_unwritable_cache_only_warns(tiny_model_dir, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(blocker))            # a file where a folder should be
    llm = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20)
    assert llm.engine.step_time_model()["source"] == "calibrated"
    assert calibration.load_cached(calibration.cache_key(llm.engine.config)) is None


def test_an_unknown_policy_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown scheduling policy 'edf'.*fcfs.*slo"):
        LLM(tiny_model_dir, scheduling_policy="edf")


def test_the_step_model_sees_the_period_between_step_starts_while_requests_remain(tiny_model_dir, monkeypatch):
    """A step's observed time runs to the next step's start (the work between steps is part of every
    TPOT); the last step before the engine idles counts its own time, and an abort that empties the engine
    leaves no period open to be closed by a much later step."""
    import time
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20)
    core = llm.engine.core
    seen: list[float] = []
    monkeypatch.setattr(core.step_model, "observe", lambda features, seconds: seen.append(seconds))
    gap_s = 0.2                                        # far above a tiny-model step
    llm.engine.add_request("a", "a b c", SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    num_steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        num_steps += 1
        time.sleep(gap_s)                              # what a server does between steps, exaggerated
    assert len(seen) == num_steps == 4                 # one prefill (with the first token), three decodes
    assert all(s >= gap_s for s in seen[:-1])          # each period holds the gap after its step
    assert seen[-1] < gap_s                            # the last: its own time, not the idle that follows
    seen.clear()
    llm.engine.add_request("b", "a b c", SamplingParams(max_tokens=50, ignore_eos=True, temperature=0))
    llm.engine.step()
    llm.engine.abort_request("b")
    time.sleep(2 * gap_s)
    llm.generate(["x"], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    assert seen and max(seen) < 2 * gap_s              # the aborted step's period was dropped, not closed late


def test_adaptive_speculation_measures_the_same_periods_as_the_step_model(tiny_model_dir, monkeypatch):
    """The adaptive draft length's measured rates and its predictions (from the step-time model) rest on one
    notion of a step's seconds: the period to the next step's start."""
    import time
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    core = llm.engine.core
    assert core.draft_length is not None
    model_seen: list[float] = []
    spec_seen: list[float] = []
    monkeypatch.setattr(core.step_model, "observe", lambda features, seconds: model_seen.append(seconds))
    monkeypatch.setattr(core.draft_length, "observe_step",
                        lambda k, decoding, seconds, tokens: spec_seen.append(seconds))
    gap_s = 0.2
    llm.engine.add_request("a", "a b a b a b a b", SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        time.sleep(gap_s)
    assert spec_seen and len(spec_seen) < len(model_seen)        # the prefill step is no sample for k
    assert set(spec_seen) <= set(model_seen)                     # the same seconds, period by period
    assert all(s >= gap_s for s in spec_seen[:-1]) and spec_seen[-1] < gap_s


def test_calibration_with_speculation_runs_plain_steps_and_leaves_the_counters_alone(tiny_model_dir, cache_dir):
    """A layer-truncated draft model drafts on every decode, random prompts included: the calibration's
    steps must not reach the counters, the decode-yield meter or the adaptive draft length."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1}
    llm = LLM(tiny_model_dir, scheduling_policy="slo", kv_cache_memory_bytes=8 << 20, block_size=4,
              speculative_config=spec)
    core = llm.engine.core
    assert llm.engine.step_time_model()["source"] == "calibrated"
    assert core.scheduler.spec_stats.num_drafts == 0 and core.draft_length.measured == {}
    assert core.scheduler.decode_yield is not None and core.scheduler.decode_yield.current.output_tokens == 1.0
    assert core.proposer is not None and core.scheduler.num_lookahead_tokens == 3     # restored
    llm.generate(["a b c"] * 2, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    assert core.scheduler.spec_stats.num_drafts > 0                   # and speculation is back for traffic


def test_the_step_trace_records_each_observed_period(tiny_model_dir, tmp_path, monkeypatch):
    """TOKENMILL_STEP_TRACE=FILE: one JSON line per step period the step-time model observes, with the model's
    prediction beside it; a file that cannot be opened is named in the error."""
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TOKENMILL_STEP_TRACE", str(trace))
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20)
    llm.generate(["one two three", "four"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    observed = llm.engine.step_time_model()["observations"]
    llm.engine.shutdown()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == observed >= 5
    assert lines[0]["prefill_tokens"] > 0 and lines[-1]["decode_rows"] >= 1
    assert all(x["seconds"] > 0 and x["predicted"] >= 0 and x["running"] >= 0 and x["pid"] > 0 for x in lines)
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
    monkeypatch.setenv("TOKENMILL_STEP_TRACE", str(tmp_path / "missing" / "steps.jsonl"))
    with pytest.raises(ValueError, match="TOKENMILL_STEP_TRACE=.*cannot open"):
        LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20)


def test_the_calibration_cache_key_tells_kv_cache_dtypes_and_amx_thresholds_apart(tiny_model_dir, monkeypatch):
    """Both change what a step runs (the attention's bytes; which kernel takes a step of 32+ rows, and from how many
    prompt rows the bfloat16 GEMM does), so a prior measured under one is not reused under the other."""
    import dataclasses

    import torch

    from tokenmill.quant import tile_kernels
    config = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20).engine.config
    bf16 = dataclasses.replace(config, model=dataclasses.replace(config.model, kv_cache_dtype=torch.bfloat16))
    assert calibration.cache_key(bf16) != calibration.cache_key(config)
    key, threshold = calibration.cache_key(config), tile_kernels.amx_threshold()
    monkeypatch.setattr(tile_kernels, "amx_threshold", lambda: threshold + 16)      # another TOKENMILL_AMX_MIN_ROWS
    assert calibration.cache_key(config) != key
