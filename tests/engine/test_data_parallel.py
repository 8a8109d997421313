"""Data parallel on this CPU: two engine-core processes behind one LLM give one engine's greedy tokens,
share the requests and free every block after 64 concurrent streams; a replica killed mid-load ends its
own requests with an error naming it while the other keeps serving; the step-time model reports the live
replicas; too many replicas fail at start-up."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.executor import ExecutorFailed

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[11, 220, 4890, 17 + i, 9] for i in range(12)]


@pytest.fixture(scope="module")
def dp_llm(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    yield llm
    llm.shutdown()


@needs_two_cores
def test_two_replicas_give_one_engines_tokens(tiny_model_factory, dp_llm):
    one = LLM(tiny_model_factory("llama"), kv_cache_memory_bytes=1 << 23, block_size=4).generate(PROMPTS, GREEDY)
    two = dp_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    sent = dp_llm.engine.core.router.admitted_total
    assert min(sent.values()) >= 3, sent                        # both replicas took a share
    model = dp_llm.engine.step_time_model()
    assert model["replicas"] == 2 and set(model["coefficients"]) >= {"intercept", "per_decode_row"}


@needs_two_cores
def test_64_concurrent_streams_then_every_block_is_free(dp_llm):
    engine = AsyncEngine(engine=dp_llm.engine)

    async def stream(i: int) -> int:
        tokens = 0
        async for out in engine.generate([5, 6, 7, i % 50 + 10], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                                temperature=0.8, seed=i),
                                         request_id=f"s{i}"):
            tokens += len(out.outputs[0].new_token_ids)
        return tokens

    async def main():
        return await asyncio.gather(*(stream(i) for i in range(64)))
    try:
        assert asyncio.run(main()) == [12] * 64
        deadline = time.monotonic() + 5
        while dp_llm.engine.stats().num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = dp_llm.engine.stats()
        assert stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    finally:
        engine._stop.set()                                       # the LLM's engine stays for other tests
        engine._commands.put(("wake", None, None))
        engine._thread.join(10)


@needs_two_cores
def test_a_killed_replica_fails_only_its_requests(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    engine = llm.engine
    try:
        long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"k{i}", [5, 6, 7 + i], long)
        outs = {}
        t0 = time.monotonic()
        victim = engine.core.replicas[1].link
        # while its requests run: 20 ms after the first step (its 300 tokens take 0.3 s on the fastest machine
        # seen, seconds on others); a timer, as a step may block that long
        killer = threading.Timer(0.02, os.kill, (victim.pid, signal.SIGKILL))
        while engine.has_unfinished_requests() and time.monotonic() - t0 < 60:
            outputs = engine.step()
            if not killer.is_alive() and not killer.finished.is_set():
                killer.start()
            for out in outputs:
                if out.finished:
                    outs[out.request_id] = out
        killer.join()
        assert len(outs) == 8
        failed = {rid for rid, o in outs.items() if o.error}
        assert 1 <= len(failed) <= 7                                 # replica 1's share only
        assert all(f"data-parallel replica 1 (pid {victim.pid}) died" in outs[rid].error for rid in failed)
        assert all(outs[rid].error_unavailable for rid in failed)   # not the request's fault: retryable
        assert all(len(o.outputs[0].token_ids) == 300 for rid, o in outs.items() if rid not in failed)
        later = llm.generate([[9, 9, 9]], GREEDY)[0]                 # the survivor keeps serving
        assert later.error is None and len(later.outputs[0].token_ids) == 8
        assert engine.step_time_model()["replicas"] == 1             # the step-time bound counts the live ones
    finally:
        llm.shutdown()


def test_more_replicas_than_cores_fail_at_start_up(tiny_model_dir):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"{cores + 1} ranks \({cores + 1} replicas x 1 tensor-parallel\) need a CPU core each"):
        LLM(tiny_model_dir, data_parallel_size=cores + 1, kv_cache_memory_bytes=1 << 22)


@needs_two_cores
def test_replicas_as_ray_actors(tiny_model_factory):
    pytest.importorskip("ray")
    model = tiny_model_factory("llama")
    one = LLM(model, kv_cache_memory_bytes=1 << 23, block_size=4).generate(PROMPTS, GREEDY)
    llm = LLM(model, data_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory_bytes=1 << 23,
              block_size=4, num_threads=2)
    try:
        two = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        assert min(llm.engine.core.router.admitted_total.values()) >= 3
        llm.engine.core.replicas[0].link.kill()                        # one dies: the other serves
        time.sleep(1.0)                                                # (its death is seen within 0.2 s)
        llm.engine.step()
        assert [r.alive for r in llm.engine.core.replicas] == [False, True]
        outs = llm.generate([[9, 9, 9]] * 3, GREEDY)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
        llm.engine.core.replicas[1].link.kill()                        # none left: the engine says so
        with pytest.raises(ExecutorFailed, match="every data-parallel replica has failed"):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                llm.engine.step()
    finally:
        llm.shutdown()
