"""VALID / INVALID for a run, with the reasons, following LoadGen's result checks.

Server (and the closed-loop concurrency runs): p99 TTFT and p99 TPOT within the limits, minimum
duration (the last query's scheduled time), minimum query count, early stopping for both TTFT and
TPOT. Offline: minimum duration (the max latency) and minimum sample count. Any failed request
(error, dropped stream, timeout) makes a run INVALID. A note says when a run is not of submission length:
a minimum it was held to below MLPerf's (600 s; 100 Server, 13,368 Offline queries), or a run short of them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tokenmill.bench.early_stopping import EarlyStoppingResult, server_early_stopping
from tokenmill.bench.metrics import percentile
from tokenmill.bench.profiles import SUBMISSION_MIN_DURATION_S, Profile, submission_min_query_count
from tokenmill.bench.runner import RunResult


@dataclass(frozen=True)
class Verdict:
    valid: bool
    reasons: tuple[str, ...]            # why INVALID (empty when VALID)
    notes: tuple[str, ...]              # said plainly in every report (e.g. not of submission length)
    perf_constraints_met: bool | None   # None: the scenario has no latency limits
    min_duration_met: bool
    min_queries_met: bool
    early_stopping_met: bool | None
    early_stopping: tuple[EarlyStoppingResult, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        return "VALID" if self.valid else "INVALID"

    def to_json(self) -> dict:
        d = asdict(self)
        d["label"] = self.label
        d["early_stopping"] = [dict(asdict(e), message=e.message()) for e in self.early_stopping]
        return d


def _latency_checks(result: RunResult, profile: Profile) -> tuple[list[str], bool | None, list[EarlyStoppingResult]]:
    done = [r for r in result.records if r.ok]
    p = profile.latency_percentile
    ttfts = [r.ttft_s for r in done]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    reasons, checks, es = [], [], []
    for metric, values, limit_ms in (("TTFT", ttfts, profile.ttft_limit_ms), ("TPOT", tpots, profile.tpot_limit_ms)):
        if limit_ms is None:
            continue
        observed = percentile(values, p)
        met = observed is not None and observed * 1000.0 <= limit_ms
        checks.append(met)
        if observed is None:
            reasons.append(f"no {metric} values measured")
        elif not met:
            reasons.append(f"p{p * 100:g} {metric} {observed * 1000.0:.1f} ms > limit {limit_ms:g} ms")
        es.append(server_early_stopping(metric, values, len(result.records), limit_ms / 1000.0, p))
    return reasons, (all(checks) if checks else None), es


def _length_notes(scenario: str, profile: Profile, duration_s: float, issued: int) -> list[str]:
    """Why a run is not of submission length: each minimum it was held to that is below MLPerf's, and where
    a minimum was MLPerf's, a run that still fell short of it (that run is also INVALID)."""
    why = profile.length_shortfalls(scenario)
    if profile.min_duration_s >= SUBMISSION_MIN_DURATION_S > duration_s:
        why.append(f"the run lasted {duration_s:.1f} s, under MLPerf's {SUBMISSION_MIN_DURATION_S:g} s")
    mlperf_count = submission_min_query_count(scenario)
    if profile.min_query_count(scenario) >= mlperf_count > issued:
        why.append(f"the run issued {issued} queries, under MLPerf's {mlperf_count} for {scenario}")
    return [f"NOT of submission length: {'; '.join(why)}"] if why else []


def judge(result: RunResult, profile: Profile) -> Verdict:
    m = result.metrics
    reasons: list[str] = []
    notes: list[str] = []
    if result.scenario == "Offline":
        perf_met, es = None, []
        duration, min_duration = m.duration_s, profile.min_duration_s
    else:
        lat_reasons, perf_met, es = _latency_checks(result, profile)
        reasons += lat_reasons
        duration, min_duration = m.final_scheduled_s, profile.min_duration_s
        if result.scenario == "Concurrency":
            duration = m.duration_s
    min_queries = profile.min_query_count(result.scenario)
    duration_met = duration >= min_duration
    if not duration_met:
        reasons.append(f"too short: {duration:.1f} s < minimum {min_duration:g} s")
    queries_met = m.num_issued >= min_queries
    if not queries_met:
        reasons.append(f"too few queries: {m.num_issued} < minimum {min_queries}")
    es_met = all(e.passed for e in es) if es else None
    reasons += [e.message() for e in es if not e.passed]
    if m.num_failed:
        detail = "; ".join(f"{n}x {msg}" for msg, n in list(m.errors.items())[:3])
        reasons.append(f"{m.num_failed} of {m.num_issued} requests failed ({detail})")
    notes += _length_notes(result.scenario, profile, duration, m.num_issued)
    if result.scenario == "Concurrency":
        notes.append("closed-loop concurrency run: not an MLPerf scenario; limits applied for reference")
    if m.num_one_token_outputs:
        notes.append(f"{m.num_one_token_outputs} requests produced 1 token: no TPOT for them")
    return Verdict(valid=not reasons, reasons=tuple(reasons), notes=tuple(notes), perf_constraints_met=perf_met,
                   min_duration_met=duration_met, min_queries_met=queries_met, early_stopping_met=es_met,
                   early_stopping=tuple(es))


def server_offline_ratio(server: RunResult | None, offline: RunResult | None) -> float | None:
    """Server completed tokens/s over Offline tokens/s, when both were measured."""
    if server is None or offline is None:
        return None
    s, o = server.metrics.completed_tokens_per_s, offline.metrics.tokens_per_s
    return s / o if s and o else None
