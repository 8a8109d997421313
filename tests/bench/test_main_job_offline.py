"""The main job's Offline run is sized as LoadGen sizes it: a run that ends before the minimum duration is
run again with enough samples to last it at the rate it showed."""
import asyncio

import pytest

from tokenmill.bench.main_job import MainJobConfig, run_offline_sized
from tokenmill.bench.profiles import get_profile
from tokenmill.bench.scenarios import offline_query_size
from tokenmill.bench.session import BenchConfig, BenchSession
from tokenmill.bench.sut.inprocess import InProcessSUT

from .fakes import FakeAsyncEngine


def test_query_size_scales_the_rate_to_the_minimum_duration_with_loadgen_headroom():
    assert offline_query_size(48, 9.0, 10.0, 480) == 58            # floor(1.1 * 10 * 48 / 9) = floor(58.67)
    assert offline_query_size(48, 12.0, 10.0, 480) == 48           # long enough already: never fewer
    assert offline_query_size(48, 0.1, 10.0, 480) == 480           # capped
    assert offline_query_size(48, 0.0, 10.0, 480) == 480           # no rate measured: the cap


@pytest.mark.parametrize("samples, most", [(0, 10), (10, 5)])
def test_query_size_rejects_bad_bounds(samples, most):
    with pytest.raises(ValueError, match="samples"):
        offline_query_size(samples, 1.0, 10.0, most)


def _offline(min_duration_s: float, ttft_s: float):
    job = MainJobConfig(num_samples=4, prompt_len="3", output_len="2", min_duration_s=min_duration_s,
                        max_offline_samples=40)
    profile = get_profile(job.profile).with_dev_length(min_duration_s, 1)
    cfg = BenchConfig(profile=profile, num_samples=job.num_samples, prompt_len=job.prompt_len,
                      output_len=job.output_len, vocab_size=1000, progress=False)
    engine = FakeAsyncEngine(ttft_s=ttft_s)          # every request takes ttft_s, all at once

    async def go():
        async with BenchSession(cfg, InProcessSUT(lambda: engine)) as session:
            return await run_offline_sized(session, job)
    return asyncio.run(go()), engine


def test_a_short_offline_run_is_run_again_over_more_samples():
    outcome, engine = _offline(min_duration_s=1.0, ttft_s=0.05)  # 4 samples in about 0.05 s: 88 wanted, 40 cap
    second = len(engine.params) - 4                              # a second run, and only one more
    assert len(outcome.result.records) == second and 4 < second <= 40
    assert all(r.ok for r in outcome.result.records)
    assert sorted({r.sample_index for r in outcome.result.records}) == [0, 1, 2, 3]   # the samples, repeated


def test_a_long_enough_offline_run_runs_once():
    outcome, engine = _offline(min_duration_s=0.01, ttft_s=0.05)
    assert len(engine.params) == 4 and len(outcome.result.records) == 4
    assert outcome.verdict.min_duration_met


def test_server_runs_hold_at_least_what_offline_completes_in_the_minimum_duration():
    """A run at a rate the engine cannot sustain must last long enough to fail, or any QPS passes: the cap
    rises to Offline's rate times twice min_duration_s (never below max_query_count)."""
    from tokenmill.bench.main_job import server_query_cap
    job = MainJobConfig(min_duration_s=10.0, max_query_count=48)
    assert server_query_cap(job, 11.2) == 224
    assert server_query_cap(job, 2.0) == 48
