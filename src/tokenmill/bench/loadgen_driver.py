"""The official MLPerf LoadGen (`mlcommons-loadgen`) as a second driver for Offline and Server runs.

LoadGen owns the schedule and the clock: it calls `issue_queries` from its own threads; each sample
runs through the same SUT adapter on our asyncio loop, and we report `FirstTokenComplete` at the first
token and `QuerySamplesComplete` with `n_tokens` at the end. LoadGen writes its own
mlperf_log_summary.txt, so its figures can be checked against ours from the very same requests. Our
records use the time LoadGen issued each query as the scheduled time (LoadGen's scheduled times are
internal to it), so our TTFT here excludes LoadGen's own issue delay. Our Offline clock starts at the
issue of the one query, as LoadGen's does; our Server clock starts just before LoadGen starts the test,
so on very short Server runs our completed tokens/s reads a little lower than LoadGen's.
"""
from __future__ import annotations

import array
import asyncio
import re
import threading
import time
from pathlib import Path

from tokenmill.bench.metrics import compute_metrics
from tokenmill.bench.records import RequestRecord
from tokenmill.bench.runner import RunResult
from tokenmill.bench.scenarios import OFFLINE_HEADROOM
from tokenmill.bench.session import BenchSession, Outcome

_MS_TO_NS = 1_000_000


def _import_loadgen():
    try:
        import mlperf_loadgen as lg
    except ImportError:
        raise ImportError("the LoadGen driver needs the official bindings: pip install mlcommons-loadgen") from None
    return lg


def _settings(lg, session: BenchSession, scenario: str, num_queries: int | None, target_qps: float | None):
    p = session.cfg.profile
    s = lg.TestSettings()
    s.mode = lg.TestMode.PerformanceOnly
    s.min_duration_ms = int(p.min_duration_s * 1000)
    s.use_token_latencies = True
    s.performance_sample_count_override = len(session.samples)
    if scenario == "Offline":
        s.scenario = lg.TestScenario.Offline
        n = num_queries or len(session.samples)
        s.min_query_count = n
        s.max_query_count = n
        # LoadGen's query: max(min_query_count, OFFLINE_HEADROOM x min duration x expected QPS) samples = n
        s.offline_expected_qps = max(n / max(p.min_duration_s, 1e-3) / OFFLINE_HEADROOM, 1e-3)
    else:
        s.scenario = lg.TestScenario.Server
        s.server_target_qps = float(target_qps)
        s.min_query_count = p.server_min_query_count
        s.server_target_latency_percentile = p.latency_percentile
        s.server_target_latency_ns = int((p.ttft_limit_ms or 0) * _MS_TO_NS)
        s.ttft_latency = int((p.ttft_limit_ms or 1e9) * _MS_TO_NS)
        s.tpot_latency = int((p.tpot_limit_ms or 1e9) * _MS_TO_NS)
    return s


class _Bridge:
    """LoadGen callbacks (its threads) -> coroutines on our loop -> LoadGen completions."""

    def __init__(self, lg, session: BenchSession, loop: asyncio.AbstractEventLoop, clock):
        self.lg, self.session, self.loop, self.clock = lg, session, loop, clock
        self.records: list[RequestRecord] = []
        self.futures = []
        self._lock = threading.Lock()
        self._token = array.array("i", [0])     # stand-in payload: performance mode does not read it

    def issue_queries(self, query_samples) -> None:
        now = self.clock()
        for qs in query_samples:
            rec = RequestRecord(f"lg-{qs.id}", int(qs.index), now)
            with self._lock:
                self.records.append(rec)
            self.futures.append(asyncio.run_coroutine_threadsafe(self._one(qs.id, rec), self.loop))

    def flush_queries(self) -> None:
        pass

    def _respond(self, fn, query_id: int, n_tokens: int) -> None:
        ptr, _ = self._token.buffer_info()
        fn([self.lg.QuerySampleResponse(query_id, ptr, self._token.itemsize, n_tokens)])

    async def _one(self, query_id: int, rec: RequestRecord) -> None:
        first_sent = False

        def on_first(_rec) -> None:
            nonlocal first_sent
            first_sent = True
            self._respond(self.lg.FirstTokenComplete, query_id, 1)

        sample = self.session.samples[rec.sample_index]
        try:
            await self.session.sut.process(sample, rec, self.clock, on_first)
        except Exception as e:   # never leave LoadGen waiting
            rec.error = f"SUT raised {type(e).__name__}: {e}"
        if not first_sent:
            self._respond(self.lg.FirstTokenComplete, query_id, 1)
        self._respond(self.lg.QuerySamplesComplete, query_id, max(rec.num_output_tokens or 0, 1))


def _shift(records: list[RequestRecord], origin_s: float) -> None:
    """Move every time in the records so that `origin_s` becomes 0."""
    for r in records:
        r.scheduled_s -= origin_s
        for name in ("sent_s", "first_token_s", "completed_s"):
            if getattr(r, name) is not None:
                setattr(r, name, getattr(r, name) - origin_s)
        r.chunk_times_s = [t - origin_s for t in r.chunk_times_s]


def parse_loadgen_summary(text: str) -> dict:
    """The headline fields of mlperf_log_summary.txt."""
    keys = {"result": r"Result is\s*:\s*(\w+)", "tokens_per_s": r"Tokens per second\s*:\s*([\d.]+)",
            "completed_tokens_per_s": r"Completed tokens per second\s*:\s*([\d.]+)",
            "completed_samples_per_s": r"Completed samples per second\s*:\s*([\d.]+)",
            "samples_per_s": r"Samples per second\s*:\s*([\d.]+)"}
    out = {}
    for key, pattern in keys.items():
        m = re.search(pattern, text)
        if m:
            out[key] = m.group(1) if key == "result" else float(m.group(1))
    return out


async def run_with_loadgen(session: BenchSession, scenario: str, num_queries: int | None, target_qps: float | None,
                           out_dir: Path) -> Outcome:
    lg = _import_loadgen()
    out_dir.mkdir(parents=True, exist_ok=True)
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    bridge = _Bridge(lg, session, loop, lambda: time.perf_counter() - t0)
    sut = lg.ConstructSUT(bridge.issue_queries, bridge.flush_queries)
    qsl = lg.ConstructQSL(len(session.samples), len(session.samples), lambda _ids: None, lambda _ids: None)
    log = lg.LogSettings()
    log.log_output.outdir = str(out_dir)
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = False
    settings = _settings(lg, session, scenario, num_queries, target_qps)
    session.meter.start()
    wall = time.time()
    try:
        await loop.run_in_executor(None, lg.StartTestWithLogSettings, sut, qsl, settings, log)
        await asyncio.gather(*(asyncio.wrap_future(f) for f in bridge.futures))
    finally:
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)
    joules = session.meter.stop_joules()
    records = sorted(bridge.records, key=lambda r: r.scheduled_s)
    if scenario == "Offline" and records:     # LoadGen's clock starts as it issues the one query
        _shift(records, records[0].scheduled_s)
    session.sut.finalize(records)
    result = RunResult(scenario, records, compute_metrics(records, session.cfg.limits), target_qps=target_qps,
                       wall_start_unix=wall, sut={**session.sut.describe(), "driver": "mlperf-loadgen"})
    o = session.outcome(result, joules, f"{scenario} (LoadGen driver)")
    summary_path = out_dir / "mlperf_log_summary.txt"
    text = summary_path.read_text() if summary_path.is_file() else ""
    o.extra["loadgen"] = {"summary_path": str(summary_path), **parse_loadgen_summary(text)}
    return o
