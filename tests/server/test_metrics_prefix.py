"""--metrics-prefix: gateways that read vLLM's metric names find them under `vllm:` unchanged."""
from __future__ import annotations

import pytest

from tokenmill.server.config import ServerConfig

VLLM_NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
              "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
              "e2e_request_latency_seconds_count"]


def test_vllm_prefix_serves_vllm_names(tiny_model_dir):
    from fastapi.testclient import TestClient

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.api_server import build_app

    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, num_threads=1))
    try:
        client = TestClient(build_app(engine, ServerConfig(metrics_prefix="vllm:"), max_num_seqs=8))
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        text = client.get("/metrics").text
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
        for name in VLLM_NAMES:
            assert "vllm:" + name in names, name
        assert not any(n.startswith("tokenmill:") for n in names)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prefix", ["9starts-with-a-digit", "has space:", "dash-"])
def test_a_prefix_that_cannot_start_a_metric_name_is_refused(prefix):
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerConfig(metrics_prefix=prefix)
