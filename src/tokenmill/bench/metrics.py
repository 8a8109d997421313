"""Run metrics, as MLPerf LoadGen defines them, computed from a list of `RequestRecord`s.

- Percentiles: nearest rank over requests, `sorted[int(n * p)]` (clamped to the last element).
- TTFT from the scheduled time; TTFT from the send time reported apart.
- TPOT per request: (latency - TTFT) / (n_tokens - 1); 1-token outputs have none and are counted.
- Offline tokens/s = total output tokens / max latency (all queries issued at t = 0).
- Server completed tokens/s = total output tokens / time at which all samples were done;
  completed samples/s = (samples - 1) / that same time (LoadGen's open-ended interval).
- Goodput: requests meeting both the TTFT and the TPOT limit, per second of run.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tokenmill.bench.records import RequestRecord

PERCENTILES = (0.5, 0.9, 0.95, 0.97, 0.99, 0.999)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile: sorted(values)[int(n * p)], clamped; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * p), len(ordered) - 1)]


def _key(p: float) -> str:
    return f"p{p * 100:g}"


def distribution(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """count/mean/min/max and the standard percentiles of `values * scale`."""
    ms = [v * scale for v in values]
    out: dict[str, float | None] = {"count": len(ms)}
    out["mean"] = sum(ms) / len(ms) if ms else None
    out["min"] = min(ms) if ms else None
    out["max"] = max(ms) if ms else None
    for p in PERCENTILES:
        out[_key(p)] = percentile(ms, p)
    return out


def distribution_ms(values_s: list[float]) -> dict[str, float | None]:
    """`distribution` of a list of seconds, in milliseconds."""
    return distribution(values_s, 1000.0)


@dataclass(frozen=True)
class Limits:
    """Latency limits of a Server-style run, both on the same percentile."""
    ttft_ms: float | None = None                # p-th percentile TTFT limit, ms (None: no limit)
    tpot_ms: float | None = None                # p-th percentile TPOT limit, ms (None: no limit)
    percentile: float = 0.99

    def request_meets(self, r: RequestRecord) -> bool:
        """Goodput test for one request (a 1-token output has no TPOT and passes that limit)."""
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1000.0 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        return not (self.tpot_ms is not None and tpot is not None and tpot * 1000.0 > self.tpot_ms)


@dataclass
class RunMetrics:
    num_issued: int
    num_completed: int
    num_failed: int
    num_one_token_outputs: int                  # completed with exactly 1 token: no TPOT
    total_output_tokens: int                    # over completed requests, from token ids
    total_prompt_tokens: int
    duration_s: float                           # s, run start to the last completion
    final_scheduled_s: float                    # s, scheduled time of the last query
    tokens_per_s: float | None                  # Offline formula: tokens / max latency
    completed_tokens_per_s: float | None        # Server formula: tokens / all-samples-done time
    completed_samples_per_s: float | None       # (samples - 1) / all-samples-done time
    request_throughput_rps: float | None        # completed requests / duration
    goodput_rps: float | None                   # requests meeting both limits / duration
    goodput_tokens_per_s: float | None          # output tokens of those requests / duration
    slo_attainment: float | None                # fraction of issued requests meeting both limits
    per_user_tokens_per_s: float | None         # 1000 / median TPOT ms
    ttft_ms: dict = field(default_factory=dict)
    ttft_sent_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)  # token-level; count 0 when not known exactly
    latency_ms: dict = field(default_factory=dict)
    issue_delay_ms: dict = field(default_factory=dict)
    output_tokens: dict = field(default_factory=dict)   # distribution of n_tokens per request (raw counts)
    errors: dict = field(default_factory=dict)          # error message -> count

    def to_json(self) -> dict:
        return asdict(self)


def _rate(numerator: float, seconds: float) -> float | None:
    return numerator / seconds if seconds > 0 else None


def compute_metrics(records: list[RequestRecord], limits: Limits | None = None) -> RunMetrics:
    """All run metrics from the records of one run (failed requests count as issued, not completed)."""
    limits = limits or Limits()
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tokens = sum(r.num_output_tokens for r in done)
    end_s = max((r.completed_s for r in done), default=0.0)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    gaps = [g for r in done for g in (r.inter_token_gaps_s() or [])]
    med_tpot = percentile(tpots, 0.5)
    good = [r for r in done if limits.request_meets(r)]
    errors: dict[str, int] = {}
    for r in failed:
        msg = r.error or "no output tokens"
        errors[msg] = errors.get(msg, 0) + 1
    return RunMetrics(
        num_issued=len(records), num_completed=len(done), num_failed=len(failed),
        num_one_token_outputs=sum(1 for r in done if r.num_output_tokens == 1),
        total_output_tokens=tokens,
        total_prompt_tokens=sum(r.num_prompt_tokens or 0 for r in done),
        duration_s=end_s,
        final_scheduled_s=max((r.scheduled_s for r in records), default=0.0),
        tokens_per_s=_rate(tokens, end_s),
        completed_tokens_per_s=_rate(tokens, end_s),
        completed_samples_per_s=_rate(len(done) - 1, end_s) if len(done) > 1 else None,
        request_throughput_rps=_rate(len(done), end_s),
        goodput_rps=_rate(len(good), end_s),
        goodput_tokens_per_s=_rate(sum(r.num_output_tokens for r in good), end_s),
        slo_attainment=len(good) / len(records) if records else None,
        per_user_tokens_per_s=1.0 / med_tpot if med_tpot else None,
        ttft_ms=distribution_ms([r.ttft_s for r in done]),
        ttft_sent_ms=distribution_ms([r.ttft_sent_s for r in done if r.ttft_sent_s is not None]),
        tpot_ms=distribution_ms(tpots),
        itl_ms=distribution_ms(gaps),
        latency_ms=distribution_ms([r.latency_s for r in done]),
        issue_delay_ms=distribution_ms([r.issue_delay_s for r in records if r.issue_delay_s is not None]),
        output_tokens=distribution([float(r.num_output_tokens) for r in done]),
        errors=errors,
    )


def tokens_over_time(records: list[RequestRecord], bucket_s: float = 1.0) -> list[tuple[float, float]]:
    """(bucket start s, output tokens/s in that bucket) from per-update arrival times."""
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
    buckets: dict[int, int] = {}
    for r in records:
        if not r.ok:
            continue
        counts = r.chunk_num_tokens if r.chunk_num_tokens and len(r.chunk_num_tokens) == len(r.chunk_times_s) \
            else None
        if counts is None:   # spread the request's tokens evenly over its updates
            n = max(len(r.chunk_times_s), 1)
            counts = [r.num_output_tokens / n] * len(r.chunk_times_s)
        for t, k in zip(r.chunk_times_s, counts):
            b = int(t // bucket_s)
            buckets[b] = buckets.get(b, 0) + k
    return [(b * bucket_s, buckets[b] / bucket_s) for b in sorted(buckets)]
