"""Latency targets per request or from the server's SLO class, and live goodput in /metrics."""
from __future__ import annotations

import math

import pytest

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import ServerConfig


def _samples(text: str, name: str) -> dict[str, float]:
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")}


def test_requests_are_judged_against_their_targets(tiny_model_dir):
    from fastapi.testclient import TestClient

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.api_server import build_app

    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, num_threads=1))
    try:
        client = TestClient(build_app(engine, ServerConfig(slo_profile="llama3.1-8b", slo_tpot_ms=60_000),
                                      max_num_seqs=8))
        text = client.get("/metrics").text
        assert math.isnan(list(_samples(text, "tokenmill:slo_attainment").values())[0])
        body = {"prompt": "judge me", "max_tokens": 4, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200           # the class: 2 s / 60 s
        assert client.post("/v1/completions", json={**body, "ttft_target_ms": 1e-6}).status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 1, "stream": True}).status_code == 200
        text = client.get("/metrics").text
        judged = _samples(text, "tokenmill:slo_requests_total")
        met = {k: v for k, v in judged.items() if 'result="met"' in k}
        missed = {k: v for k, v in judged.items() if 'result="missed"' in k}
        assert sum(v for k, v in met.items() if 'target="ttft"' in k) == 2
        assert sum(v for k, v in missed.items() if 'target="ttft"' in k) == 1
        assert sum(v for k, v in met.items() if 'target="tpot"' in k) == 2      # the 1-token chat has none
        goodput = _samples(text, "tokenmill:slo_goodput_requests_total")
        assert sorted(goodput.values()) == [1.0, 2.0]
        assert list(_samples(text, "tokenmill:slo_attainment").values())[0] == pytest.approx(2 / 3)
    finally:
        engine.shutdown()


def test_the_slo_class_comes_from_a_profile_or_flags():
    assert (ServerConfig(slo_profile="llama3.1-8b-interactive").slo_ttft_ms,
            ServerConfig(slo_profile="llama3.1-8b-interactive").slo_tpot_ms) == (500.0, 30.0)
    assert ServerConfig(slo_profile="llama3.1-8b", slo_ttft_ms=900).slo_ttft_ms == 900
    with pytest.raises(ValueError, match="unknown profile"):
        ServerConfig(slo_profile="nope")
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        ServerConfig(slo_tpot_ms=-1)


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf"), "100", True])
def test_bad_targets_are_refused(value):
    with pytest.raises(ValueError, match="ttft_target_ms"):
        SamplingParams(ttft_target_ms=value)


def test_metrics_show_the_step_time_model_of_an_slo_server(tiny_model_dir, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.api_server import build_app

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, num_threads=1, scheduling_policy="slo"))
    try:
        client = TestClient(build_app(engine, ServerConfig(slo_ttft_ms=2000, slo_tpot_ms=100), max_num_seqs=8))
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}).status_code == 200
        lines = [l for l in client.get("/metrics").text.splitlines() if l.startswith("tokenmill:step_time_model")]
        terms = {l.split('term="')[1].split('"')[0]: float(l.split()[-1]) for l in lines if "term=" in l}
        assert set(terms) == {"intercept", "per_decode_row", "per_prefill_token", "per_context_read",
                              "per_prefill_step", "per_mixed_step"}
        assert terms["intercept"] > 0 and all(v >= 0 for v in terms.values())
        observed = [float(l.split()[-1]) for l in lines if l.startswith("tokenmill:step_time_model_observations")]
        assert observed and observed[0] >= 4
        assert [l.split()[-1] for l in lines if l.startswith("tokenmill:step_time_model_replicas")] == ["1.0"]
        assert not [l for l in lines if "decode_yield" in l]         # no speculation: no yield to report
    finally:
        engine.shutdown()


def test_metrics_show_the_decode_yield_of_a_speculating_server(tiny_model_dir, tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from tokenmill.bench.session import step_time_model_from_metrics
    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.api_server import build_app

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, num_threads=1, scheduling_policy="slo",
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    try:
        client = TestClient(build_app(engine, ServerConfig(slo_ttft_ms=2000, slo_tpot_ms=100), max_num_seqs=8))
        assert client.post("/v1/completions", json={"prompt": "a b c a b c a b c", "max_tokens": 12,
                                                    "temperature": 0}).status_code == 200
        model = step_time_model_from_metrics(client.get("/metrics").text)
        assert model["decode_yield"]["output_tokens"] >= 1.0
        assert model["decode_yield"]["new_tokens"] >= model["decode_yield"]["output_tokens"]
    finally:
        engine.shutdown()
