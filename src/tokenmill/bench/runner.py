"""Drives one scenario against one SUT: issues queries on schedule and collects `RequestRecord`s.

The schedule is made before the run. The issuing loop only sleeps and creates tasks, so its own
lateness (issue delay = actual send - scheduled) stays small; it is measured for every request.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tokenmill.bench.metrics import Limits, RunMetrics, compute_metrics
from tokenmill.bench.records import RequestRecord, Sample
from tokenmill.bench.scenarios import ConcurrencyScenario, Scenario, ScheduledQuery
from tokenmill.bench.sut.base import SUT

SLEEP_MARGIN_S = 0.0005    # wake this early and yield until due (asyncio timers round to ~1 ms)


@dataclass
class RunResult:
    scenario: str                       # "Offline" | "Server" | "Concurrency"
    records: list[RequestRecord]
    metrics: RunMetrics
    target_qps: float | None = None
    concurrency: int | None = None
    wall_start_unix: float = 0.0        # s since the epoch, when the run began
    sut: dict = field(default_factory=dict)


class _Progress:
    """A rich progress bar when enabled; a no-op otherwise."""

    def __init__(self, enabled: bool, total: int, label: str):
        self._bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[tokens]} tok"), TimeElapsedColumn(), transient=False)
            self._task = self._bar.add_task(label, total=total, tokens=0)
            self._tokens = 0
            self._bar.start()

    def done(self, record: RequestRecord) -> None:
        if self._bar is not None:
            self._tokens += record.num_output_tokens or 0
            self._bar.update(self._task, advance=1, tokens=self._tokens)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


async def _issue(sut: SUT, sample: Sample, record: RequestRecord, clock, timeout_s: float | None,
                 progress: _Progress) -> None:
    try:
        await asyncio.wait_for(sut.process(sample, record, clock), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
        await sut.abort(record.request_id)
    except Exception as e:   # a SUT bug must not end the run
        record.error = f"SUT raised {type(e).__name__}: {e}"
    progress.done(record)


async def _open_loop(sut, samples, schedule: list[ScheduledQuery], clock, timeout_s, progress, prefix):
    records, tasks = [], []
    loop = asyncio.get_running_loop()
    for q in schedule:
        wait = q.scheduled_s - clock()
        if wait > SLEEP_MARGIN_S:
            await asyncio.sleep(wait - SLEEP_MARGIN_S)
        while clock() < q.scheduled_s:
            await asyncio.sleep(0)
        rec = RequestRecord(f"{prefix}-{q.query_index}", q.sample_index, q.scheduled_s)
        records.append(rec)
        tasks.append(loop.create_task(_issue(sut, samples[q.sample_index], rec, clock, timeout_s, progress)))
    await asyncio.gather(*tasks)
    return records


async def _closed_loop(sut, samples, schedule: list[ScheduledQuery], concurrency: int, clock, timeout_s,
                       progress, prefix):
    records: list[RequestRecord] = []
    queue = iter(schedule)

    async def user() -> None:
        for q in queue:      # shared iterator: each user takes the next query when it is free
            rec = RequestRecord(f"{prefix}-{q.query_index}", q.sample_index, clock())
            records.append(rec)
            await _issue(sut, samples[q.sample_index], rec, clock, timeout_s, progress)

    await asyncio.gather(*(user() for _ in range(concurrency)))
    records.sort(key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    return records


async def run_scenario_async(sut: SUT, samples: list[Sample], scenario: Scenario, limits: Limits | None = None,
                             timeout_s: float | None = None, progress: bool = False, prefix: str = "q") -> RunResult:
    """Run one scenario on a started SUT; returns records and metrics. Never raises for request failures."""
    schedule = scenario.schedule(len(samples))
    bar = _Progress(progress, len(schedule), scenario.name)
    wall = time.time()
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    try:
        if isinstance(scenario, ConcurrencyScenario):
            records = await _closed_loop(sut, samples, schedule, scenario.concurrency, clock, timeout_s, bar, prefix)
        else:
            records = await _open_loop(sut, samples, schedule, clock, timeout_s, bar, prefix)
    finally:
        bar.close()
    sut.finalize(records)
    return RunResult(scenario=scenario.name, records=records, metrics=compute_metrics(records, limits),
                     target_qps=getattr(scenario, "target_qps", None),
                     concurrency=getattr(scenario, "concurrency", None), wall_start_unix=wall, sut=sut.describe())


async def with_sut(sut: SUT, body):
    """Start the SUT, await `body(sut)`, always close it."""
    await sut.start()
    try:
        return await body(sut)
    finally:
        await sut.close()
