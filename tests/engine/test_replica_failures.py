"""Data-parallel replicas that fail (engine/replicas.py, engine/replica_links.py): a replica whose core
raises (in its process, or in the serving thread of its Ray actor) says why before it stops, and its
requests end with that error instead of hanging; an idle AsyncEngine whose every replica died notices on
its own and is dead (the server answers 503 and exits for its supervisor); a replica that hangs alive
blocks no add and is killed after replica_timeout_s of silence, its requests failing like a dead one's."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.errors import EngineDeadError, RequestUnavailableError
from conftest import process_ended_within

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[11, 220, 4890, 17 + i, 9] for i in range(12)]


@needs_two_cores
@pytest.mark.parametrize("backend", [None, "ray"])       # None: a process per replica
def test_a_replica_whose_core_raises_fails_its_requests_with_the_error(tiny_model_factory, backend):
    if backend == "ray":
        pytest.importorskip("ray")
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, distributed_executor_backend=backend,
              kv_cache_memory_bytes=1 << 23, block_size=4, num_threads=2)
    try:
        llm.engine.core.replicas[0].link.send(("add", None, 0))       # its core raises on this command
        result: list = []

        def generate():
            try:
                result.append(llm.generate(PROMPTS, GREEDY))
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                result.append(e)
        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "generate hung on a replica whose core raised"
        # the 12 prompts are routed before the first step reads replica 0's end: some went to it
        assert isinstance(result[0], RequestUnavailableError), result[0]
        assert "data-parallel replica 0 failed: AttributeError" in str(result[0])
        assert [r.alive for r in llm.engine.core.replicas] == [False, True]
        outs = llm.generate(PROMPTS[:3], GREEDY)                        # the other one serves on
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    finally:
        llm.shutdown()


@needs_two_cores
def test_an_idle_engine_notices_that_every_replica_died(tiny_model_factory):
    engine = AsyncEngine(EngineArgs(model=tiny_model_factory("llama"), data_parallel_size=2,
                                    kv_cache_memory_bytes=1 << 23, block_size=4))
    try:
        for replica in engine.engine.core.replicas:
            os.kill(replica.link.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.dead is not None, "the engine never noticed that no replica is left"
        assert engine.died_of_bug                                      # the server exits non-zero
        assert "every data-parallel replica has failed" in str(engine.dead)
        assert "(pid" in str(engine.dead) and "died" in str(engine.dead)

        async def one():
            async for _ in engine.generate([5, 6, 7], GREEDY, request_id="late"):
                pass
        with pytest.raises(EngineDeadError):
            asyncio.run(one())
        assert not engine.engine.requests
    finally:
        engine.shutdown()


@needs_two_cores
def test_a_hung_replica_neither_blocks_the_front_nor_holds_its_requests(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4,
              num_threads=2)
    engine, core = llm.engine, llm.engine.core
    core.replica_timeout_s = 5.0
    hung = core.replicas[1].link
    os.kill(hung.pid, signal.SIGSTOP)                  # alive, but it reads its pipe no more
    # half of 300 prompts of 400 tokens (about 3 KB each pickled) is more than its pipe's buffer holds
    prompts = {f"h{i}": [100 + i] + [1000 + (i * 7 + j) % 5000 for j in range(399)] for i in range(300)}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    adder = threading.Thread(target=lambda: [engine.add_request(rid, p, params) for rid, p in prompts.items()],
                             daemon=True)
    try:
        t0 = time.monotonic()
        adder.start()
        adder.join(10)
        assert not adder.is_alive(), "adding requests blocked on the hung replica's pipe"
        outs = {}
        while engine.has_unfinished_requests() and time.monotonic() - t0 < 120:
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
        assert len(outs) == 300, "requests still in flight after 120 s"
        failed = {rid for rid, o in outs.items() if o.error}
        assert 1 <= len(failed) < 300                                  # the hung replica's share only
        assert all("data-parallel replica 1 answered nothing for 5 s" in outs[rid].error for rid in failed)
        assert all(len(o.outputs[0].token_ids) == 2 for rid, o in outs.items() if rid not in failed)
        assert [r.alive for r in core.replicas] == [True, False]
        assert process_ended_within(hung.pid, 10), "the hung replica was not killed"
    finally:
        hung.proc.kill()                               # unblocks a send stuck on its pipe (old code)
        adder.join(30)
        llm.shutdown()
    assert not any(r.link.sender.is_alive() for r in core.replicas), "a sender thread outlived shutdown"
