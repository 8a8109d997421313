"""End-to-end `tokenmill bench` on the real engine in-process (the default model, a handful of tokens)."""
import json

import pytest

from tokenmill.bench.cli import main

pytestmark = pytest.mark.slow


def test_inprocess_server_and_offline_on_default_model(tmp_path):
    code = main(["bench", "server", "--target-qps", "4", "--with-offline", "--num-samples", "4",
                 "--prompt-len", "16", "--output-len", "4", "--min-duration-s", "0.5", "--min-query-count", "4",
                 "--max-query-count", "4", "--no-progress", "--out-dir", str(tmp_path), "--request-timeout-s", "120"])
    assert code == 0
    data = json.loads((tmp_path / "server.json").read_text())
    offline, server = data["runs"]
    for run in (offline, server):
        m = run["metrics"]
        assert m["num_failed"] == 0, m["errors"]
        assert m["total_output_tokens"] == 4 * m["num_completed"]        # exact outputs: ignore_eos
        assert m["itl_ms"]["count"] > 0                                 # exact tokens per update
        assert run["sut"]["name"] == "in-process"
    assert "enable_prefix_caching=False" in server["sut"]["engine_args"]   # MLPerf profile: no KV reuse
    assert data["summary"]["server_offline_ratio"] > 0
    bound = data["summary"]["step_time_bound"]          # from the engine's step-time model after the run
    assert bound["tokens_per_s"] > 0 and bound["fraction_reached"] > 0
    assert 0.0 <= bound["queueing_ceiling"]["utilization"] <= 1.0     # at the profile's 2 s TTFT limit
    assert bound["queueing_ceiling"]["ttft_limit_ms"] == 2000.0
    report = (tmp_path / "server.md").read_text()
    assert "Step-time bound" in report and "Queueing ceiling" in report
