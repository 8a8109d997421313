"""`tokenmill bench server` over HTTP against a real `tokenmill serve` process (tiny random model):
token counts from the server's usage, MLPerf metrics present, and a dropped server counted as failures."""
from __future__ import annotations

import json

import pytest

from server.conftest import ServerProcess
from tokenmill.bench.cli import main

COMMON = ["--num-samples", "6", "--prompt-len", "16", "--output-len", "8", "--no-progress",
          "--min-duration-s", "0.5", "--min-query-count", "6"]


@pytest.fixture(scope="module")
def tokenmill_server(tiny_model_dir, tmp_path_factory):
    srv = ServerProcess(tiny_model_dir, str(tmp_path_factory.mktemp("bench-serve") / "server.log"),
                        "--kv-cache-memory-bytes", str(8 << 20))
    yield srv
    srv.stop()


def test_server_scenario_against_tokenmill_serve(tokenmill_server, tiny_model_dir, tmp_path, capsys):
    code = main(["bench", "server", "--url", tokenmill_server.url, "--served-model-name", tiny_model_dir,
                 "--tokenizer", tiny_model_dir, "--target-qps", "4", "--with-offline", "--out-dir", str(tmp_path),
                 *COMMON])
    assert code == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "server.json").read_text())
    offline, server = data["runs"]
    for run in (offline, server):
        m = run["metrics"]
        assert m["num_failed"] == 0 and m["num_completed"] == m["num_issued"] >= 6
        assert m["total_output_tokens"] == 8 * m["num_completed"]      # exact lengths, counted from usage
    assert server["metrics"]["ttft_ms"]["p99"] > 0 and server["metrics"]["tpot_ms"]["p99"] > 0
    assert data["summary"]["server_offline_ratio"] is not None
    assert data["summary"]["step_time_bound"]["tokens_per_s"] > 0       # from the server's /metrics model


def test_unreachable_url_is_counted_and_invalid(tmp_path, capsys):
    code = main(["bench", "server", "--url", "http://127.0.0.1:9", "--served-model-name", "m",
                 "--vocab-size", "1000", "--target-qps", "20", "--out-dir", str(tmp_path), *COMMON])
    assert code == 0
    run = json.loads((tmp_path / "server.json").read_text())["runs"][0]
    assert run["verdict"]["label"] == "INVALID"
    assert run["metrics"]["num_failed"] == run["metrics"]["num_issued"]
