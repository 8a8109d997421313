"""In-process SUT through the AsyncEngine API (a fake engine here; the real one in test_e2e_engine)."""
import asyncio

from tokenmill.bench.metrics import Limits
from tokenmill.bench.records import Sample
from tokenmill.bench.runner import run_scenario_async, with_sut
from tokenmill.bench.scenarios import ConcurrencyScenario, OfflineScenario, ServerScenario
from tokenmill.bench.sut.inprocess import InProcessSUT

from .fakes import FakeAsyncEngine


def run(engine, scenario, ds, **kw):
    sut = InProcessSUT(lambda: engine)
    return asyncio.run(with_sut(sut, lambda s: run_scenario_async(s, ds, scenario, Limits(1000, 50), **kw)))


def test_exact_token_counts_and_itl_from_token_ids():
    eng = FakeAsyncEngine(ttft_s=0.01, step_s=0.004, tokens_per_step=2)
    ds = [Sample(i, (5, 6, 7), 3, 5, min_output_tokens=5, ignore_eos=True) for i in range(3)]
    res = run(eng, ServerScenario(100.0, 0.0, 5, seed=0), ds)
    assert eng.shut
    assert all(r.ok and r.num_output_tokens == 5 and r.chunk_num_tokens == [2, 2, 1] for r in res.records)
    assert res.metrics.itl_ms["count"] == 5 * 4
    p = eng.params[0]
    assert (p.temperature, p.max_tokens, p.min_tokens, p.ignore_eos) == (0.0, 5, 5, True)


def test_text_prompt_and_engine_errors_are_recorded():
    eng = FakeAsyncEngine()
    ds = [Sample(0, "hello world", None, 3), Sample(1, "boom", None, 3)]
    res = run(eng, OfflineScenario(2), ds)
    ok, bad = sorted(res.records, key=lambda r: r.sample_index)
    assert ok.ok and ok.num_prompt_tokens == 2 and ok.num_output_tokens == 3
    assert "kaboom" in bad.error and res.metrics.num_failed == 1


def test_closed_loop_keeps_concurrency_and_timeouts_abort():
    eng = FakeAsyncEngine(ttft_s=0.0, step_s=0.01)
    ds = [Sample(0, (1,), 1, 3, ignore_eos=True)]
    res = run(eng, ConcurrencyScenario(3, 9), ds)
    assert res.metrics.num_completed == 9 and res.concurrency == 3
    starts = sorted(r.scheduled_s for r in res.records)
    assert starts[2] - starts[0] < 0.01 and starts[3] - starts[0] > 0.015   # 3 at once, then as slots free
    slow = FakeAsyncEngine(ttft_s=1.0)
    res = run(slow, OfflineScenario(2), ds, timeout_s=0.1)
    assert res.metrics.num_failed == 2 and len(slow.aborted) == 2
