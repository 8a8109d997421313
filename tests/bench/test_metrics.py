"""Metric math on synthetic timelines with known answers."""
import pytest

from tokenmill.bench.metrics import Limits, compute_metrics, percentile, tokens_over_time
from tokenmill.bench.records import RequestRecord


def rec(i, sched, sent, first, done, n, chunks=None, error=None):
    r = RequestRecord(f"r{i}", i, sched, sent_s=sent, first_token_s=first, completed_s=done,
                      num_output_tokens=n, error=error)
    if chunks is not None:
        r.chunk_times_s = [t for t, _ in chunks]
        r.chunk_num_tokens = [k for _, k in chunks]
    return r


def test_nearest_rank_percentile():
    values = list(range(1, 101))           # 1..100
    assert percentile(values, 0.5) == 51   # sorted[int(100 * 0.5)]
    assert percentile(values, 0.99) == 100
    assert percentile(values, 0.9) == 91
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([], 0.5) is None
    assert percentile([3, 1, 2], 0.999) == 3   # clamped to the last element


def test_ttft_tpot_and_latency_from_scheduled_time():
    r = rec(0, sched=1.0, sent=1.002, first=1.5, done=2.5, n=11)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.ttft_sent_s == pytest.approx(0.498)
    assert r.issue_delay_s == pytest.approx(0.002)
    assert r.latency_s == pytest.approx(1.5)
    assert r.tpot_s == pytest.approx(0.1)      # (1.5 - 0.5) / (11 - 1)


def test_one_token_output_has_no_tpot_but_is_counted():
    m = compute_metrics([rec(0, 0, 0, 0.2, 0.2, 1), rec(1, 0, 0, 0.1, 1.1, 11)])
    assert m.num_one_token_outputs == 1
    assert m.tpot_ms["count"] == 1
    assert m.tpot_ms["p50"] == pytest.approx(100.0)


def test_offline_and_server_token_rates():
    records = [rec(i, 0.0, 0.0, 0.5, 1.0 + i, 10) for i in range(4)]   # done at 1, 2, 3, 4 s
    m = compute_metrics(records)
    assert m.total_output_tokens == 40
    assert m.tokens_per_s == pytest.approx(10.0)            # 40 tokens / max latency 4 s
    assert m.completed_tokens_per_s == pytest.approx(10.0)  # 40 / all-done time 4 s
    assert m.completed_samples_per_s == pytest.approx(0.75) # (4 - 1) / 4 s
    assert m.request_throughput_rps == pytest.approx(1.0)


def test_failed_requests_counted_not_measured():
    records = [rec(0, 0, 0, 0.1, 1.0, 10), rec(1, 0, 0, None, None, None, error="HTTP 500")]
    m = compute_metrics(records)
    assert (m.num_issued, m.num_completed, m.num_failed) == (2, 1, 1)
    assert m.errors == {"HTTP 500": 1}
    assert m.total_output_tokens == 10


def test_goodput_counts_requests_meeting_both_limits():
    records = [rec(0, 0, 0, 0.1, 1.0, 10),     # ttft 100 ms, tpot 100 ms
               rec(1, 0, 0, 0.3, 1.2, 10),     # ttft 300 ms: fails TTFT 200
               rec(2, 0, 0, 0.1, 2.0, 10)]     # tpot 211 ms: fails TPOT 150
    m = compute_metrics(records, Limits(ttft_ms=200, tpot_ms=150))
    assert m.goodput_rps == pytest.approx(1 / 2.0)


def test_token_level_itl_spreads_multi_token_chunks():
    r = rec(0, 0, 0, 1.0, 1.6, 5, chunks=[(1.0, 1), (1.2, 1), (1.6, 3)])
    assert r.inter_token_gaps_s() == pytest.approx([0.2, 0.4 / 3, 0.4 / 3, 0.4 / 3])
    m = compute_metrics([r])
    assert m.itl_ms["count"] == 4
    assert m.tpot_ms["p50"] == pytest.approx(150.0)   # 0.6 s / 4


def test_itl_not_available_without_exact_chunk_counts():
    r = rec(0, 0, 0, 1.0, 2.0, 5)
    r.chunk_times_s = [1.0, 2.0]
    assert r.inter_token_gaps_s() is None
    assert compute_metrics([r]).itl_ms["count"] == 0


def test_tokens_over_time_buckets():
    r = rec(0, 0, 0, 0.5, 1.5, 3, chunks=[(0.5, 1), (1.2, 1), (1.5, 1)])
    assert tokens_over_time([r], 1.0) == [(0.0, 1.0), (1.0, 2.0)]


def test_the_step_time_model_is_read_from_a_tokenmill_servers_metrics():
    from tokenmill.bench.session import step_time_model_from_metrics
    text = "\n".join([
        "# HELP tokenmill:step_time_model_seconds ...",
        'tokenmill:step_time_model_seconds{model_name="m",term="intercept"} 0.05',
        'tokenmill:step_time_model_seconds{model_name="m",term="per_decode_row"} 0.002',
        'tokenmill:step_time_model_seconds{model_name="m",term="per_prefill_token"} 0.001',
        'tokenmill:step_time_model_seconds{model_name="m",term="per_context_read"} 1e-06',
        'tokenmill:step_time_model_observations_total{model_name="m"} 42.0'])
    model = step_time_model_from_metrics(text)
    assert model["coefficients"]["intercept"] == 0.05 and model["observations"] == 42
    assert model["per_1k_context_reads_ms"] == pytest.approx(1.0) and model["replicas"] == 1
    assert model["coefficients"]["per_prefill_step"] == model["coefficients"]["per_mixed_step"] == 0.0
    with_step = step_time_model_from_metrics(
        text + '\ntokenmill:step_time_model_seconds{model_name="m",term="per_prefill_step"} 0.003')
    assert with_step["per_prefill_step_ms"] == pytest.approx(3.0)
    assert step_time_model_from_metrics("vllm:num_requests_running 3") is None
    replicated = step_time_model_from_metrics(text + '\ntokenmill:step_time_model_replicas{model_name="m"} 2.0')
    assert replicated["replicas"] == 2
    assert model["decode_yield"] is None
    speculating = step_time_model_from_metrics(text + "".join(
        f'\ntokenmill:step_time_model_decode_yield_tokens{{model_name="m",kind="{k}"}} {v}'
        for k, v in (("new", 4.5), ("output", 2.25))))
    assert speculating["decode_yield"] == {"new_tokens": 4.5, "output_tokens": 2.25}


def test_the_step_time_bound_of_data_parallel_replicas_is_theirs_together():
    """Each replica runs its own steps within the TPOT limit: N replicas allow N times one's rows and tok/s."""
    from types import SimpleNamespace
    from tokenmill.bench.workflows import bound_section, step_time_bound
    coefficients = {"intercept": 0.02, "per_decode_row": 0.002, "per_prefill_token": 0.0005, "per_context_read": 1e-7}
    records = [SimpleNamespace(ok=True, num_prompt_tokens=128, num_output_tokens=128)] * 4

    def bound(replicas):
        server = SimpleNamespace(extra={"step_time_model": {"coefficients": coefficients, "replicas": replicas}},
                                 result=SimpleNamespace(records=records, metrics=SimpleNamespace(completed_tokens_per_s=300.0)))
        return step_time_bound(server, 100.0)

    one, two = bound(1), bound(2)
    assert one["replicas"] == 1 and two["replicas"] == 2
    for key in ("rows", "tokens_per_s", "unbounded_batch_tokens_per_s"):
        assert two[key] == pytest.approx(2 * one[key])
    assert two["fraction_reached"] == pytest.approx(one["fraction_reached"] / 2)
    assert f"{one['rows']:.1f} decode rows per 100 ms step in each of 2 replicas" in bound_section(two)[0]


def test_the_report_says_when_verify_tokens_count_as_decode_rows():
    from tokenmill.bench.report import _step_model_lines
    model = {"intercept_ms": 5.0, "per_decode_row_ms": 0.3, "per_prefill_token_ms": 0.1,
             "per_1k_context_reads_ms": 0.01, "observations": 9}
    assert "decode rows:" not in _step_model_lines(model)[0]
    assert "decode rows:" not in _step_model_lines({**model, "decode_rows": {"max_query_len": 1, "max_rows": 0}})[0]
    fused = _step_model_lines({**model, "decode_rows": {"max_query_len": 17, "max_rows": 4096}})[0]
    assert "a step with prefill: n/a ms, n/a ms more beside decode rows" in fused
    assert "a step with prefill: 2.50 ms, 2.20 ms more beside decode rows" in _step_model_lines(
        {**model, "per_prefill_step_ms": 2.5, "per_mixed_step_ms": 2.2})[0]
    assert "up to 17 new tokens" in fused and "verify steps included" in fused


def test_the_report_gives_the_decode_yield_with_speculation():
    from tokenmill.bench.report import _step_model_lines
    model = {"intercept_ms": 5.0, "per_decode_row_ms": 0.3, "per_prefill_token_ms": 0.1,
             "per_1k_context_reads_ms": 0.01, "observations": 9}
    assert len(_step_model_lines({**model, "decode_yield": None})) == 1
    lines = _step_model_lines({**model, "decode_yield": {"new_tokens": 4.2, "decode_rows": 4.2, "prefill_tokens": 0.0,
                                                         "output_tokens": 2.5}})
    assert "computes 4.20 new tokens a step and yields 2.50 output tokens" in lines[1]
