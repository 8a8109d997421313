"""HTTP SUT and runner against the in-test fake OpenAI streaming server."""
import asyncio
import json
import time
from dataclasses import replace

import pytest

from tokenmill.bench.fake_openai import FakeOpenAIServer, FakeServerConfig
from tokenmill.bench.metrics import Limits, compute_metrics
from tokenmill.bench.profiles import get_profile
from tokenmill.bench.records import RequestRecord, Sample
from tokenmill.bench.runner import run_scenario_async, with_sut
from tokenmill.bench.scenarios import ConcurrencyScenario, OfflineScenario, ServerScenario
from tokenmill.bench.sut.http import HttpConfig, HttpSUT
from tokenmill.bench.verdict import judge

from .fakes import WordTokenizer

# p50 limits so that a short run can pass early stopping (needs 7 queries at t = 0)
DEV = replace(get_profile("custom", ttft_ms=2000, tpot_ms=100).with_dev_length(0.1, 1), latency_percentile=0.5)


def samples(n=4, out=5, exact=True):
    return [Sample(i, (101, 102, 103), 3, out, min_output_tokens=out if exact else 0, ignore_eos=exact)
            for i in range(n)]


def run(server_cfg, scenario, ds, tokenizer=None, timeout_s=None, url=None):
    async def body(sut):
        return await run_scenario_async(sut, ds, scenario, Limits(2000, 100), timeout_s=timeout_s)

    async def main():
        with FakeOpenAIServer(server_cfg) as srv:
            sut = HttpSUT(HttpConfig(url or srv.url), tokenizer=tokenizer)
            return await with_sut(sut, body), srv
    return asyncio.run(main())


def test_server_run_counts_tokens_from_usage_not_chunks():
    res, srv = run(FakeServerConfig(ttft_s=0.02, token_delay_s=0.005, tokens_per_chunk=3),
                   ServerScenario(50.0, 0.0, 8, seed=1), samples(out=7))
    m = res.metrics
    assert m.num_completed == 8 and m.num_failed == 0
    assert all(r.num_output_tokens == 7 and len(r.chunk_times_s) == 3 for r in res.records)   # 3+3+1
    assert m.total_output_tokens == 56
    assert m.ttft_ms["min"] >= 20.0
    assert m.itl_ms["count"] == 0            # tokens per chunk unknown without a tokenizer
    body = srv.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 7 and body["model"] == "fake-model"
    assert body["prompt"] == [101, 102, 103]
    v = judge(res, DEV)
    assert v.valid, v.reasons
    assert any("NOT of submission length" in n for n in v.notes)
    strict = judge(res, get_profile("llama3.1-8b"))     # p99 with 8 queries: early stopping fails
    assert not strict.valid and any("early stopping" in r for r in strict.reasons)
    assert any("too short" in r for r in strict.reasons)


def test_extras_sent_only_when_asked_and_retokenization_fallback():
    res, srv = run(FakeServerConfig(send_usage=False, natural_len=4), OfflineScenario(3),
                   samples(3, out=16, exact=False), tokenizer=WordTokenizer())
    assert "ignore_eos" not in srv.bodies[0] and "min_tokens" not in srv.bodies[0]
    assert [r.num_output_tokens for r in res.records] == [4, 4, 4]     # "tok " x 4 re-tokenized
    assert res.metrics.itl_ms["count"] == 9                              # 3 requests x (4 - 1) gaps


def test_no_usage_and_no_tokenizer_is_an_error_not_a_chunk_count():
    res, _ = run(FakeServerConfig(send_usage=False), OfflineScenario(2), samples(2))
    assert res.metrics.num_failed == 2
    assert "no usage" in res.records[0].error


def test_errors_and_dropped_streams_are_counted_and_invalidate():
    res, _ = run(FakeServerConfig(fail_every_n=3, drop_every_n=4), ConcurrencyScenario(2, 12), samples())
    m = res.metrics
    assert m.num_issued == 12 and m.num_failed == 6        # 500s at 3, 6, 9, 12; drops at 4, 8
    errors = " ".join(m.errors)
    assert "HTTP 500" in errors and "stream dropped" in errors
    v = judge(res, DEV)
    assert not v.valid and any("requests failed" in r for r in v.reasons)


def test_unreachable_url_fails_every_request_without_crashing():
    async def main():
        sut = HttpSUT(HttpConfig("http://127.0.0.1:9", model="m", connect_timeout_s=2.0))
        return await with_sut(sut, lambda s: run_scenario_async(s, samples(3), OfflineScenario(3)))
    res = asyncio.run(main())
    assert res.metrics.num_failed == 3 and res.metrics.num_completed == 0
    assert "connection failed" in res.records[0].error
    assert not judge(res, DEV).valid


def test_unreachable_url_model_discovery_is_a_clear_error():
    async def main():
        await HttpSUT(HttpConfig("http://127.0.0.1:9", connect_timeout_s=2.0)).start()
    with pytest.raises(ConnectionError, match="cannot list models"):
        asyncio.run(main())


def test_request_timeout_is_recorded():
    res, _ = run(FakeServerConfig(ttft_s=1.0), OfflineScenario(2), samples(2), timeout_s=0.2)
    assert res.metrics.num_failed == 2 and "timed out" in res.records[0].error


class CannedStreamSUT(HttpSUT):
    """An HttpSUT whose responses are the given server-sent-event lines."""

    def __init__(self, lines):
        super().__init__(HttpConfig("http://127.0.0.1:9", model="m"))
        self.canned = lines

    async def _lines(self, body):
        for line in self.canned:
            yield line


def _events(tokens: int, finish_reason: str) -> list[bytes]:
    chunks = [{"choices": [{"text": "tok ", "finish_reason": None}]} for _ in range(tokens)]
    chunks.append({"choices": [{"text": "", "finish_reason": finish_reason}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": tokens}})
    return [b"data: " + json.dumps(c).encode() for c in chunks] + [b"data: [DONE]"]


def _streamed(tokens, finish_reason, min_output_tokens):
    sample = Sample(0, (101,), 1, 5, min_output_tokens=min_output_tokens)
    record = RequestRecord("r0", 0, 0.0)
    asyncio.run(CannedStreamSUT(_events(tokens, finish_reason)).process(sample, record, time.perf_counter))
    return record


@pytest.mark.parametrize("tokens, finish_reason, min_tokens, error", [
    (2, "abort", 1, "finish_reason 'abort'"),         # the server shut down mid-request
    (5, "error", 0, "finish_reason 'error'"),
    (2, "stop", 5, "output truncated"),              # min_tokens 5 asked, 2 delivered
    (0, "length", 1, "output truncated"),
])
def test_an_aborted_or_truncated_stream_is_a_failed_request(tokens, finish_reason, min_tokens, error):
    record = _streamed(tokens, finish_reason, min_tokens)
    assert not record.ok and error in record.error
    assert compute_metrics([record]).num_failed == 1


@pytest.mark.parametrize("tokens, finish_reason, min_tokens", [(2, "stop", 1), (5, "length", 5), (3, "stop", 0)])
def test_an_output_ended_by_eos_above_its_minimum_is_ok(tokens, finish_reason, min_tokens):
    record = _streamed(tokens, finish_reason, min_tokens)     # cnndm: min 1, EOS may end it anywhere
    assert record.ok and record.num_output_tokens == tokens
