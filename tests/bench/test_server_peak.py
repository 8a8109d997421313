"""benchmarks/server_peak.py's bookkeeping, without servers: which report it reads, when a held run counts,
and how rounds and unconfirmed peaks reach its tables."""
import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "server_peak.py"
_spec = importlib.util.spec_from_file_location("server_peak", _SCRIPT)
server_peak = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = server_peak          # dataclasses look their module up while the script loads
_spec.loader.exec_module(server_peak)


def _bench_args(out_dir) -> argparse.Namespace:
    return argparse.Namespace(profile="llama3.1-8b", dataset="synthetic", num_samples=8, prompt_len=8, output_len=4,
                              out_dir=str(out_dir))


def test_a_cli_run_that_writes_no_report_raises_instead_of_reading_an_older_one(tmp_path, monkeypatch):
    (tmp_path / "sys_r1_peak.json").write_text(json.dumps({"summary": {"peak_qps": 9.9}, "runs": []}))

    def crashed(cmd, **kw):
        kw["stderr"].write(b"Traceback (most recent call last):\nRuntimeError: engine died\n")
        return subprocess.CompletedProcess(cmd, 1)
    monkeypatch.setattr(server_peak.subprocess, "run", crashed)
    with pytest.raises(RuntimeError, match=r"status 1 and wrote no report(.|\n)*engine died"):
        server_peak.bench(_bench_args(tmp_path), "http://127.0.0.1:9", "find-peak", "sys_r1_peak", [])
    assert not (tmp_path / "sys_r1_peak.json").exists()


def test_a_cli_run_reads_the_report_it_wrote(tmp_path, monkeypatch):
    (tmp_path / "sys_r1_peak.json").write_text(json.dumps({"summary": {"peak_qps": 9.9}}))

    def wrote(cmd, **kw):
        out = Path(cmd[cmd.index("--out-dir") + 1]) / (cmd[cmd.index("--name") + 1] + ".json")
        out.write_text(json.dumps({"summary": {"peak_qps": 1.5}}))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(server_peak.subprocess, "run", wrote)
    report = server_peak.bench(_bench_args(tmp_path), "http://127.0.0.1:9", "find-peak", "sys_r1_peak", [])
    assert report["summary"]["peak_qps"] == 1.5


def _server_report(label: str) -> dict:
    """A 600 s Server run at 1.2 QPS: 720 queries, the p99s within the limits, no failure."""
    metrics = {"completed_tokens_per_s": 150.0, "total_output_tokens": 720 * 128, "num_completed": 720,
               "num_issued": 720, "num_failed": 0, "ttft_ms": {"p99": 900.0}, "tpot_ms": {"p99": 80.0}}
    verdict = {"label": label, "perf_constraints_met": True, "early_stopping_met": label == "VALID"}
    return {"summary": {}, "runs": [{"metrics": metrics, "verdict": verdict}]}


def test_a_held_run_must_be_valid_not_only_within_the_limits(monkeypatch):
    reports = iter([_server_report("INVALID"), _server_report("VALID")])   # the first fails early stopping
    targets = []

    def bench(args, url, command, name, extra):
        targets.append(float(extra[extra.index("--target-qps") + 1]))
        return next(reports)
    monkeypatch.setattr(server_peak, "bench", bench)
    args = argparse.Namespace(confirm_tries=2, confirm_duration_s=600.0, min_query_count=100, confirm_backoff=0.9)
    held = server_peak.hold_peak(args, "http://127.0.0.1:9", "sys_r1", 1.2)
    assert [r["verdict"] for r in held["held_runs"]] == ["INVALID", "VALID"]
    assert held["held_qps"] == targets[1] == pytest.approx(1.08)          # backed off once: 1.2 x 0.9


def test_peak_figures_carry_whether_the_peak_was_confirmed():
    run = {"metrics": {"completed_tokens_per_s": 120.0, "ttft_ms": {"p99": 800.0}, "tpot_ms": {"p99": 90.0}}}
    summary = {"peak_qps": 1.5, "peak_confirmed": False, "failed_confirmations": [1.5, 1.425]}
    figures = server_peak.peak_figures({"summary": summary, "runs": [run]})
    assert figures["peak_confirmed"] is False and figures["peak_failed_confirmations"] == [1.5, 1.425]
    assert server_peak.peak_figures({"summary": {}, "runs": []})["peak_confirmed"] is None


def _round(peak_qps, server_tps, held_qps=None, confirmed=True, offline_tps=100.0) -> dict:
    return {"offline_tps": offline_tps, "offline_runs_tps": [offline_tps], "peak_qps": peak_qps,
            "peak_confirmed": confirmed if peak_qps else None, "peak_failed_confirmations": [],
            "server_tps": server_tps, "ttft_p99": 500.0, "tpot_p99": 50.0, "bound_tps": None,
            "held_qps": held_qps, "held_tps": held_qps and 100 * held_qps, "held_ttft_p99": None,
            "held_tpot_p99": None, "held_bound_tps": None, "held_runs": []}


def _report_args(out_dir, rounds) -> argparse.Namespace:
    return argparse.Namespace(min_duration_s=60.0, profile="llama3.1-8b", dataset="synthetic", prompt_len=128,
                              output_len=128, quantization="int4", rounds=rounds, confirm_duration_s=600.0,
                              out_dir=str(out_dir))


def _table_line(out: str, table_heading: str, system: str) -> str:
    table = out.split(table_heading, 1)[1]
    return next(line for line in table.splitlines() if line.startswith(f"| {system} |"))


def test_rounds_without_a_held_qps_count_in_the_median(tmp_path, capsys):
    results = {"tokenmill-slo": [_round(1.5, 150.0), _round(1.6, 160.0), _round(1.4, 140.0, held_qps=1.2)]}
    rows = server_peak.report(_report_args(tmp_path, 3), results)
    held = rows["tokenmill-slo"]["held"]
    assert held["qps"] is None and held["rounds_with_qps"] == 1 and held["rounds"] == 3
    line = _table_line(capsys.readouterr().out, "held (a VALID run)", "tokenmill-slo")
    assert "| - |" in line and "1 of 3" in line and "1.200" not in line


def test_each_rows_figures_come_from_one_round(tmp_path, capsys):
    results = {"tokenmill-slo": [_round(2.0, 25.0), _round(1.0, 10.0), _round(3.0, 15.0)]}
    peak = server_peak.report(_report_args(tmp_path, 3), results)["tokenmill-slo"]["peak"]
    assert (peak["round"], peak["qps"], peak["tps"]) == (1, 2.0, 25.0)   # not the tok/s column's median, 15
    line = _table_line(capsys.readouterr().out, "| system |", "tokenmill-slo")
    assert "| 2.000 | 1 | 3 of 3 | 25.0 |" in line
    saved = json.loads((tmp_path / "server_peak.json").read_text())
    assert saved["rows"]["tokenmill-slo"]["peak"]["round"] == 1


def test_an_unconfirmed_peak_is_marked_in_the_table(tmp_path, capsys):
    results = {"tokenmill-slo": [_round(1.5, 150.0, confirmed=False)], "llama-server": [_round(1.0, 100.0)]}
    server_peak.report(_report_args(tmp_path, 1), results)
    out = capsys.readouterr().out
    assert "| 1.500* |" in _table_line(out, "| system |", "tokenmill-slo")
    assert "| 1.000 |" in _table_line(out, "| system |", "llama-server")
    assert "* not confirmed" in out


def test_kv_cache_variants_set_the_cache_dtype_and_combine_with_the_others():
    args = argparse.Namespace(systems="slo,slo+bf16kv,fcfs+dp2+fp8kv", quantization="int4", profile="llama3.1-8b",
                              speculative_config=None, llama_server="/nonexistent", llama_slots=16)
    built = {s.name: s.command for s in server_peak.systems(args, "model.gguf", 8123)}
    assert "--kv-cache-dtype" not in built["tokenmill-slo"]
    cmd = built["tokenmill-slo+bf16kv"]
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "bfloat16"
    cmd = built["tokenmill-fcfs+dp2+fp8kv"]
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8" and "--data-parallel-size" in cmd
    args.systems = "slo+bf16kv+fp8kv"
    with pytest.raises(SystemExit, match="unknown system"):
        server_peak.systems(args, "model.gguf", 8123)


def test_a_revision_system_serves_that_revisions_source_with_the_flags_every_revision_takes(tmp_path, monkeypatch):
    """fcfs@REV: `tokenmill serve` with PYTHONPATH at a worktree of REV (made under --out-dir, git's own
    `worktree add` mocked here), no --scheduling-policy (older CLIs have none); slo+bf16kv@REV: today's flags
    for that system, REV's source; malformed forms refused by name."""
    made = []

    def worktree_add(cmd, **kw):
        made.append(cmd)
        (Path(cmd[-2]) / "src" / "tokenmill").mkdir(parents=True)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(server_peak.subprocess, "run", worktree_add)
    args = argparse.Namespace(systems="fcfs@abc1234,slo,slo+bf16kv@abc1234", quantization="int4", profile="llama3.1-8b",
                              speculative_config=None, llama_server="/nonexistent", llama_slots=16,
                              out_dir=str(tmp_path))
    built = {s.name: s for s in server_peak.systems(args, "model.gguf", 8123)}
    old = built["tokenmill-fcfs@abc1234"]
    assert "--scheduling-policy" not in old.command and old.command[-2:] == ["--quantization", "int4"]
    assert old.env["PYTHONPATH"] == str(tmp_path.resolve() / "tree-abc1234" / "src")
    assert made[0][-3:] == ["--detach", str(tmp_path.resolve() / "tree-abc1234"), "abc1234"]
    assert built["tokenmill-slo"].env is None and "--scheduling-policy" in built["tokenmill-slo"].command
    paired = built["tokenmill-slo+bf16kv@abc1234"]
    assert paired.env["PYTHONPATH"] == old.env["PYTHONPATH"]
    assert paired.command[paired.command.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert paired.command[paired.command.index("--scheduling-policy") + 1] == "slo"
    server_peak.systems(args, "model.gguf", 8123)
    assert len(made) == 1                                     # the worktree is made once, then reused
    for bad in ("fcfs@", "fcfs@abc+bf16kv"):
        args.systems = bad
        with pytest.raises(SystemExit, match="NAME@REV, its extras before"):
            server_peak.systems(args, "model.gguf", 8123)
    args.systems = "lifo@abc1234"
    with pytest.raises(SystemExit, match="unknown system"):
        server_peak.systems(args, "model.gguf", 8123)
