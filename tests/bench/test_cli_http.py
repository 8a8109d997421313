"""End-to-end `tokenmill bench` commands over HTTP against the fake OpenAI server (fast)."""
import json
import sys

import pytest

from tokenmill.bench.cli import main
from tokenmill.bench.fake_openai import FakeOpenAIServer, FakeServerConfig

COMMON = ["--vocab-size", "1000", "--num-samples", "8", "--prompt-len", "8", "--output-len", "4",
          "--no-progress", "--min-duration-s", "0.3", "--min-query-count", "6"]


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(FakeServerConfig(ttft_s=0.01, token_delay_s=0.002)) as srv:
        yield srv


def test_server_with_offline_writes_all_outputs(server, tmp_path, capsys):
    code = main(["bench", "server", "--url", server.url, "--target-qps", "40", "--with-offline",
                 "--out-dir", str(tmp_path), *COMMON])
    assert code == 0
    out = capsys.readouterr().out
    assert "Completed tokens per second" in out and "Result is : INVALID" in out   # early stopping: too few
    data = json.loads((tmp_path / "server.json").read_text())
    assert [r["scenario"] for r in data["runs"]] == ["Offline", "Server"]
    # --min-query-count sets Server's minimum; Offline keeps MLPerf's
    assert "too few queries: 8 < minimum 13368" in data["runs"][0]["verdict"]["reasons"]
    assert data["summary"]["server_offline_ratio"] is not None
    server_run = data["runs"][1]
    assert server_run["metrics"]["num_failed"] == 0 and server_run["metrics"]["num_issued"] >= 6
    assert any("early stopping" in r for r in server_run["verdict"]["reasons"])
    md = (tmp_path / "server.md").read_text()
    assert "Not of submission length" in md and "Server/Offline ratio" in md
    assert len(list(tmp_path.glob("*.png"))) == 4 and len(list(tmp_path.glob("*_requests.jsonl"))) == 2
    line = json.loads((tmp_path / "server_offline_requests.jsonl").read_text().splitlines()[0])
    assert {"ttft_s", "tpot_s", "issue_delay_s", "num_output_tokens"} <= set(line)


def test_sweep_writes_pareto_csv_and_png(server, tmp_path):
    assert main(["bench", "sweep", "--url", server.url, "--concurrency", "1,4", "--queries-per-level", "8",
                 "--out-dir", str(tmp_path), *COMMON]) == 0
    assert (tmp_path / "sweep_pareto.csv").is_file() and (tmp_path / "sweep_pareto.png").is_file()


def test_find_peak_over_http(server, tmp_path):
    assert main(["bench", "find-peak", "--url", server.url, "--start-qps", "20", "--max-runs", "3",
                 "--max-query-count", "8", "--profile", "custom", "--ttft-ms", "1000", "--tpot-ms", "100",
                 "--out-dir", str(tmp_path), *COMMON]) == 0
    data = json.loads((tmp_path / "find_peak.json").read_text())
    runs = data["summary"]["runs"]
    # the widening run at 40 QPS ends its 8 queries before the 0.3 s minimum: a fail, then the run cap
    assert [(r["phase"], r["meets_limits"]) for r in runs] == [("base", True), ("widen", False), ("bisect", True)]
    assert runs[1]["misses"][0].startswith("too short")
    assert data["summary"]["peak_qps"] == 30 and data["summary"]["peak_confirmed"] is False
    assert "find-peak" in (tmp_path / "find_peak.md").read_text()


def test_user_errors_exit_2_without_traceback(tmp_path, capsys):
    assert main(["bench", "offline", "--url", "http://127.0.0.1:9", "--out-dir", str(tmp_path), *COMMON]) == 2
    assert "cannot list models" in capsys.readouterr().err
    assert main(["bench", "offline", "--url", "http://127.0.0.1:9", "--served-model-name", "m",
                 "--dataset", "jsonl", "--out-dir", str(tmp_path), *COMMON]) == 2
    assert "--dataset-path" in capsys.readouterr().err


def test_unreachable_url_with_model_name_runs_and_is_invalid(tmp_path):
    assert main(["bench", "offline", "--url", "http://127.0.0.1:9", "--served-model-name", "m",
                 "--out-dir", str(tmp_path), *COMMON]) == 0
    run = json.loads((tmp_path / "offline.json").read_text())["runs"][0]
    assert run["metrics"]["num_failed"] == 8 and run["verdict"]["label"] == "INVALID"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="mlcommons-loadgen wheels: CPython 3.11")
def test_loadgen_driver_matches_our_figures(server, tmp_path):
    pytest.importorskip("mlperf_loadgen")
    assert main(["bench", "server", "--driver", "loadgen", "--url", server.url, "--target-qps", "40",
                 "--with-offline", "--out-dir", str(tmp_path), *COMMON]) == 0
    data = json.loads((tmp_path / "server.json").read_text())
    for run in data["runs"]:
        lg = run["loadgen"]
        ours = run["metrics"]["tokens_per_s"] if run["scenario"] == "Offline" else run["metrics"]["completed_tokens_per_s"]
        theirs = lg.get("tokens_per_s") or lg.get("completed_tokens_per_s")
        # Offline clocks agree; Server: ours starts before LoadGen's start-up (short runs read lower)
        assert theirs == pytest.approx(ours, rel=0.05 if run["scenario"] == "Offline" else 0.3)
        assert lg["result"] in ("VALID", "INVALID")
    assert (tmp_path / "loadgen_server" / "mlperf_log_summary.txt").is_file()
