"""find-peak search logic and the sweep's Pareto frontier, on a fake session with known behaviour."""
import asyncio

from tokenmill.bench.find_peak import PeakSearchConfig, find_peak
from tokenmill.bench.metrics import compute_metrics
from tokenmill.bench.profiles import get_profile
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import RunResult
from tokenmill.bench.session import Outcome
from tokenmill.bench.sweep import pareto_frontier, run_sweep, write_sweep_csv
from tokenmill.bench.verdict import judge

PROFILE = get_profile("custom", ttft_ms=1000, tpot_ms=100).with_dev_length(0, 1)


class FakeSession:
    """TPOT grows with load: tpot_ms = 40 * qps (limit 100 ms -> true peak 2.5 QPS)."""

    def __init__(self, flaky_at=None):
        self.qps_tried = []
        self.flaky_at = flaky_at

    async def run(self, scenario, label=None, prefix="q"):
        load = getattr(scenario, "target_qps", None) or scenario.concurrency
        self.qps_tried.append(load)
        tpot = 0.040 * load if self.flaky_at != len(self.qps_tried) else 1.0
        recs = [RequestRecord(f"{prefix}-{i}", 0, i * 0.1, sent_s=i * 0.1, first_token_s=i * 0.1 + 0.05,
                              completed_s=i * 0.1 + 0.05 + 10 * tpot, num_output_tokens=11) for i in range(5)]
        result = RunResult(scenario.name, recs, compute_metrics(recs), target_qps=getattr(scenario, "target_qps", None),
                           concurrency=getattr(scenario, "concurrency", None))
        return Outcome(label or scenario.name, result, judge(result, PROFILE))


def test_find_peak_converges_below_the_true_peak_and_confirms():
    s = FakeSession()
    res = asyncio.run(find_peak(s, PeakSearchConfig(0.5, precision=0.05, max_runs=20)))
    assert 2.5 * 0.95 <= res.peak_qps <= 2.5
    phases = [r["phase"] for r in res.rows]
    assert phases[0] == "base" and "widen" in phases and "bisect" in phases and phases[-1] == "confirm"
    assert s.qps_tried[:4] == [0.5, 1.0, 2.0, 4.0]           # doubling until the first failure
    assert res.peak.result.target_qps == res.peak_qps


def test_failed_confirmation_backs_off_one_step():
    s = FakeSession()
    res = asyncio.run(find_peak(s, PeakSearchConfig(0.5, precision=0.05, max_runs=20)))
    n = len(res.runs)
    flaky = FakeSession(flaky_at=n)                           # the confirming run fails once
    res2 = asyncio.run(find_peak(flaky, PeakSearchConfig(0.5, precision=0.05, max_runs=20)))
    assert res2.peak_qps == res.peak_qps * 0.95
    assert [r["phase"] for r in res2.rows][-2:] == ["confirm", "confirm"]


def test_a_failed_confirmation_without_room_to_back_off_is_reported_as_such():
    n = len(asyncio.run(find_peak(FakeSession(), PeakSearchConfig(0.5, precision=0.05, max_runs=20))).runs)
    res = asyncio.run(find_peak(FakeSession(flaky_at=n), PeakSearchConfig(0.5, precision=0.05, max_runs=n)))
    assert not res.confirmed and res.rows[-1]["phase"] == "confirm" and not res.rows[-1]["meets_limits"]
    assert res.failed_confirmations == [res.rows[-1]["target_qps"]] and res.peak_qps is not None
    head = [line for line in _sections(res) if line.startswith("**Peak")][0]
    assert "NOT confirmed" in head and f"{res.failed_confirmations[0]:.4g} QPS missed the limits" in head


def _sections(res):
    import tempfile
    from tokenmill.bench.workflows import peak_sections
    with tempfile.TemporaryDirectory() as d:
        return peak_sections(res, d, "peak")


def test_start_too_high_halves_then_gives_up():
    res = asyncio.run(find_peak(FakeSession(), PeakSearchConfig(100.0, max_runs=20, max_halvings=2)))
    assert res.peak_qps is None and [r["target_qps"] for r in res.rows] == [100.0, 50.0, 25.0]


def test_run_cap():
    res = asyncio.run(find_peak(FakeSession(), PeakSearchConfig(0.5, precision=0.001, max_runs=4)))
    assert len(res.runs) == 4 and res.stopped_by_max_runs


def test_run_cap_during_widening_still_reports_the_best_passing_run():
    # regression: a cap reached before any failure used to report "no QPS met the limits"
    res = asyncio.run(find_peak(FakeSession(), PeakSearchConfig(0.5, precision=0.001, max_runs=3)))
    assert [r["target_qps"] for r in res.rows] == [0.5, 1.0, 2.0] and all(r["meets_limits"] for r in res.rows)
    assert res.peak_qps == 2.0 and res.peak is res.runs[-1] and not res.confirmed


def test_time_budget_stops_new_runs():
    res = asyncio.run(find_peak(FakeSession(), PeakSearchConfig(0.5, time_budget_s=0.0)))
    assert res.rows == [] and res.peak_qps is None and res.stopped_by_max_runs


class QueueSession:
    """A server completing `capacity` queries/s first come first served: TTFT is the wait in its queue plus
    10 ms, TPOT 10 ms. Queries arrive on the scenario's own schedule, its query cap included."""

    def __init__(self, profile, capacity):
        self.profile, self.capacity = profile, capacity

    async def run(self, scenario, label=None, prefix="q"):
        free_at, recs = 0.0, []
        for i, t in enumerate(scenario.arrival_times()):
            first = max(t, free_at) + 0.01
            free_at = max(t, free_at) + 1.0 / self.capacity
            recs.append(RequestRecord(f"{prefix}-{i}", 0, t, sent_s=t, first_token_s=first,
                                      completed_s=first + 0.1, num_output_tokens=11))
        result = RunResult("Server", recs, compute_metrics(recs), target_qps=scenario.target_qps)
        return Outcome(label or "Server", result, judge(result, self.profile))


def test_a_run_cut_short_by_the_query_cap_is_not_a_pass():
    """8 queries are 2 s of work for a 4 QPS server: as a burst, any QPS meets a 2 s p99 TTFT. A run passes
    only when its 8 queries span the 4 s minimum duration, which keeps the peak under the server's rate."""
    profile = get_profile("custom", ttft_ms=2000, tpot_ms=100).with_dev_length(4.0, 4)
    cfg = PeakSearchConfig(1.0, precision=0.1, max_runs=10, min_duration_s=4.0, min_query_count=4, max_query_count=8)
    res = asyncio.run(find_peak(QueueSession(profile, capacity=4.0), cfg))
    assert res.peak_qps is not None and res.peak_qps < 4.0
    for o, row in zip(res.runs, res.rows):
        assert row["meets_limits"] == (o.verdict.min_duration_met and bool(o.verdict.perf_constraints_met))
    short = [row for o, row in zip(res.runs, res.rows) if not o.verdict.min_duration_met]
    assert short and all(r["ttft_p99_ms"] < 2000 for r in short)          # within the limits, yet no pass
    assert all(any(m.startswith("too short") for m in r["misses"]) for r in short)
    assert "| no (too short" in "\n".join(_sections(res))
    # early stopping is not part of the search's pass: a p99 over a few queries cannot satisfy it
    assert res.peak.verdict.label == "INVALID" and res.peak.verdict.early_stopping_met is False


def test_a_run_with_fewer_queries_than_its_minimum_is_not_a_pass():
    from tokenmill.bench.find_peak import meets_limits
    profile = get_profile("custom", ttft_ms=2000, tpot_ms=100).with_dev_length(0.0, 6)
    o = asyncio.run(QueueSession(profile, capacity=100.0).run(_capped_scenario(5)))
    assert o.verdict.perf_constraints_met and o.result.metrics.num_issued == 5
    assert not meets_limits(o)


def _capped_scenario(n):
    from tokenmill.bench.scenarios import ServerScenario
    return ServerScenario(10.0, 0.0, 6, max_query_count=n)


def test_a_failing_start_bounds_the_search_and_no_qps_runs_twice_before_confirmation():
    s = FakeSession()                                         # true peak 2.5
    res = asyncio.run(find_peak(s, PeakSearchConfig(4.0, precision=0.05, max_runs=20)))
    searched = [r["target_qps"] for r in res.rows if r["phase"] != "confirm"]
    assert searched[:2] == [4.0, 2.0] and len(set(searched)) == len(searched)
    assert all(q < 4.0 for q in searched[1:])                 # nothing at or above the known fail
    assert res.confirmed and 2.5 * 0.95 <= res.peak_qps <= 2.5


def test_the_summary_says_whether_the_peak_was_confirmed():
    from tokenmill.bench.workflows import peak_summary
    confirmed = asyncio.run(find_peak(FakeSession(), PeakSearchConfig(0.5, precision=0.05, max_runs=20)))
    assert peak_summary(confirmed, None)["peak_confirmed"] is True
    n = len(confirmed.runs)
    missed = asyncio.run(find_peak(FakeSession(flaky_at=n), PeakSearchConfig(0.5, precision=0.05, max_runs=n)))
    summary = peak_summary(missed, None)
    assert summary["peak_qps"] is not None and summary["peak_confirmed"] is False
    assert summary["failed_confirmations"] == [missed.rows[-1]["target_qps"]]


def test_pareto_frontier():
    pts = [{"concurrency": c, "per_user_tokens_per_s": x, "tokens_per_s": y}
           for c, x, y in [(1, 50, 50), (2, 45, 90), (4, 30, 80), (8, 20, 160), (16, 10, 150)]]
    assert [p["concurrency"] for p in pareto_frontier(pts)] == [8, 2, 1]


def test_sweep_runs_each_level(tmp_path):
    outcomes, points, frontier = asyncio.run(run_sweep(FakeSession(), [1, 2, 4], None))
    assert [p["concurrency"] for p in points] == [1, 2, 4]
    assert all(p["per_user_tokens_per_s"] > 0 for p in points)
    path = write_sweep_csv(points, frontier, tmp_path / "s.csv")
    assert path.read_text().splitlines()[0].endswith("pareto")
