"""benchmarks/step_trace_summary.py over a trace written by engine/step_trace.py's StepTrace."""
import importlib.util
import sys
from pathlib import Path

import pytest

from tokenmill.core.step_time import StepFeatures
from tokenmill.engine.step_trace import StepTrace

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_trace_summary.py"
_spec = importlib.util.spec_from_file_location("step_trace_summary", _SCRIPT)
summary = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = summary
_spec.loader.exec_module(summary)


def _write(path, steps) -> None:
    trace = StepTrace(str(path))
    for rows, prefill, seconds, predicted in steps:
        trace.record(StepFeatures(rows, prefill, 0), seconds, predicted, running=rows, waiting=0)
    trace.close()


def test_periods_are_grouped_by_decode_rows_and_prefill_with_the_models_error_and_the_prefill_share(tmp_path):
    path = tmp_path / "steps.jsonl"
    # three decode-only steps of 4-6 rows, one of 20 rows, two of 5 rows beside a 100-token prompt
    _write(path, [(4, 0, 0.010, 0.011), (5, 0, 0.012, 0.012), (6, 0, 0.014, 0.007), (20, 0, 0.030, 0.033),
                  (5, 100, 0.060, 0.054), (5, 100, 0.080, 0.080)])
    s = summary.summarize(summary.read_trace(str(path)), bucket=16)
    groups = {(g["rows_from"], g["with_prefill"]): g for g in s["groups"]}
    assert set(groups) == {(0, False), (16, False), (0, True)}
    assert groups[(0, False)]["steps"] == 3 and groups[(0, False)]["period_ms"] == pytest.approx(12.0)
    assert groups[(0, False)]["predicted_ms"] == pytest.approx(11.0)
    assert groups[(16, False)]["rows_to"] == 31 and groups[(16, False)]["running"] == 20
    assert groups[(0, True)]["period_ms"] == pytest.approx(70.0) and groups[(0, True)]["prefill_tokens"] == 100
    # relative errors: 0.1, 0, 0.5, 0.1, 0.1, 0 -> median 0.1
    assert s["median_relative_error"] == pytest.approx(0.1)
    assert s["prefill_time_share"] == pytest.approx(0.140 / 0.206)
    assert s["steps"] == 6 and s["seconds"] == pytest.approx(0.206)


def test_one_cores_lines_and_a_late_start_can_be_picked(tmp_path):
    path = tmp_path / "steps.jsonl"
    line = '{"t": %s, "pid": %d, "seconds": 0.01, "predicted": 0.01, "decode_rows": 1, "prefill_tokens": 0, ' \
           '"context_reads": 9, "running": 1, "waiting": 0}'
    path.write_text("\n".join([line % (0.5, 7), line % (1.5, 8), line % (2.5, 7)]) + "\n")
    assert [r["t"] for r in summary.read_trace(str(path), pid=7)] == [0.5, 2.5]
    assert [r["t"] for r in summary.read_trace(str(path), since_s=1.0)] == [1.5, 2.5]
    with pytest.raises(ValueError, match="bucket must be >= 1"):
        summary.summarize(summary.read_trace(str(path)), bucket=0)


def test_an_empty_trace_summarizes_to_no_groups(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text("")
    s = summary.summarize(summary.read_trace(str(path)))
    assert s["groups"] == [] and s["median_relative_error"] is None and s["prefill_time_share"] is None
