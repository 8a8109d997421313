"""Data-parallel replicas apply the front's commands as sent, and a reused request id cannot be confused
(engine/replicas.py, engine/replica_links.py): commands that reach a threaded Ray actor out of order are
put back in order (an abort that overtakes its add still aborts it); an update a replica sent before an
abort reached it never lands on a new request that reuses the id (one engine has no such window); an LLM
dropped without shutdown() stops its replica processes."""
from __future__ import annotations

import gc
import os
import queue
import random
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.distributed.dp_router import ReplicaLoad
from tokenmill.engine import replicas as replicas_module
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.replica_links import InOrder, serve_replica
from tokenmill.engine.replicas import ReplicatedCore, ReplicaUpdate
from conftest import process_ended_within

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas need two cores")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def one_engine(tiny_model_dir):
    return LLMEngine(EngineArgs(model=tiny_model_dir, kv_cache_memory_bytes=1 << 23, block_size=4))


def _unread_update_of(core: ReplicatedCore, rid: str) -> bool:
    """Whether the front's inbox holds an update of request `rid` that no step() has read yet."""
    return any(kind == "updates" and any(u.request_id == rid for u in value[0])
               for _, (kind, value) in list(core.inbox.queue))


def _run_to_end(engine) -> dict:
    outs = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return outs


# ---- A: commands in the order sent -----------------------------------------------------------------------
def test_in_order_hands_on_items_by_number_whatever_order_they_come_in():
    got = []
    in_order = InOrder(got.append)
    in_order.put(2, "c")
    in_order.put(1, "b")
    assert got == []                                   # 0 not yet there: nothing may go ahead of it
    in_order.put(0, "a")
    assert got == ["a", "b", "c"]
    with pytest.raises(ValueError, match="item number 1 was put twice"):
        in_order.put(1, "again")
    numbers = list(range(3, 403))
    random.Random(0).shuffle(numbers)
    threads = [threading.Thread(target=lambda part=numbers[i::8]: [in_order.put(n, n) for n in part])
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["a", "b", "c", *range(3, 403)]


def test_an_abort_delivered_before_its_add_still_aborts_the_request(one_engine):
    """As the Ray actor takes them: each command with its number, the abort's call run first."""
    commands, messages = queue.Queue(), queue.Queue()
    in_order = InOrder(commands.put)
    in_order.put(1, ("abort", ["x"], FinishReason.ABORT, None))
    in_order.put(0, ("add", Request("x", [5, 6, 7], LONG), 0))
    in_order.put(2, ("add", Request("probe", [5, 6, 8], GREEDY), 1))
    server = threading.Thread(target=serve_replica, args=(one_engine.core, commands.get,
                                                          lambda: not commands.empty(), messages.put), daemon=True)
    server.start()
    updates = []
    while not any(u.request_id == "probe" and u.finished for u in updates):
        kind, value = messages.get(timeout=60)
        assert kind == "updates", value
        updates.extend(value[0])
    in_order.put(3, ("shutdown",))
    server.join(60)
    assert not server.is_alive()
    assert not [u for u in updates if u.request_id == "x"], "the aborted request ran"
    assert not one_engine.core.has_unfinished()


@needs_two_cores
def test_a_ray_replica_applies_an_abort_after_the_add_it_follows(tiny_model_factory):
    pytest.importorskip("ray")
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, distributed_executor_backend="ray",
              kv_cache_memory_bytes=1 << 23, block_size=4, num_threads=2)
    core = llm.engine.core
    try:
        link = core.replicas[0].link
        for i in range(8):                             # behind the front's back: the link alone
            request = Request(f"x{i}", [5, 6, 7 + i], LONG)
            request.ballast = bytes(1 << 20)           # Ray passes a large argument through its object store:
            link.send(("add", request, i))             # the actor may run the abort's call before the add's
            link.send(("abort", [f"x{i}"], FinishReason.ABORT, None))
        updates, deadline = [], time.monotonic() + 60
        while time.monotonic() < deadline:             # until the replica is quiet for 2 s
            try:
                index, (kind, value) = core.inbox.get(timeout=2.0)
            except queue.Empty:
                break
            assert kind == "updates", value
            updates.extend(value[0])
        ran_out = sorted({u.request_id for u in updates if u.finished})
        assert not ran_out, f"aborted requests ran to max_tokens: {ran_out}"
    finally:
        llm.shutdown()


# ---- B: a reused request id ---------------------------------------------------------------------------------
class _FakeLink:
    """A replica that records the commands sent to it; the test writes its messages to the inbox."""

    def __init__(self, index: int, config, threads: int, inbox: queue.Queue) -> None:
        self.index, self.sent, self.pid = index, [], None

    def wait_ready(self, timeout_s: float):
        return 64, 0, {}

    def send(self, message) -> None:
        self.sent.append(message)

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        pass


def _update(rid: str, serial: int, tokens: list[int], finished: bool = False) -> ReplicaUpdate:
    return ReplicaUpdate(rid, serial, tokens, [], None, finished, FinishReason.LENGTH if finished else None,
                         None, 0, 0.0, 0)


@pytest.mark.parametrize("same_replica", [True, False])
def test_a_stale_update_never_lands_on_a_request_that_reuses_the_id(one_engine, monkeypatch, same_replica):
    monkeypatch.setattr(replicas_module, "PipeLink", _FakeLink)
    monkeypatch.setattr("tokenmill.executor.mp.check_ranks_fit", lambda *a: None)
    core = ReplicatedCore(one_engine.config, 2, 2, False)
    core.router.choose = lambda prompt, live: 0        # the first request on replica 0
    first = Request("x", [5, 6, 7], LONG)
    core.add_request(first)
    old_serial = core.replicas[0].link.sent[-1][2]
    core.abort(["x"])
    core.router.choose = lambda prompt, live: 0 if same_replica else 1
    second = Request("x", [5, 6, 8], GREEDY)
    core.add_request(second)
    new_replica = core.replicas[0 if same_replica else 1]
    kind, sent, new_serial = new_replica.link.sent[-1]
    assert kind == "add" and sent is second and new_serial != old_serial
    # replica 0 stepped the first x before it read the abort: its update comes after the new add
    core.inbox.put((0, ("updates", ([_update("x", old_serial, [42], finished=True)], ReplicaLoad(0, 0), None, None))))
    assert core.step() == []
    assert second.output_token_ids == [] and not second.is_finished
    core.inbox.put((new_replica.index, ("updates", ([_update("x", new_serial, [7, 8], finished=True)],
                                                    ReplicaLoad(0, 0), None, None))))
    [update] = core.step()
    assert update.request is second and update.new_token_ids == [7, 8]
    assert second.output_token_ids == [7, 8] and second.is_finished and not core.requests


@needs_two_cores
def test_updates_sent_before_an_abort_do_not_reach_the_id_added_again(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    engine, core = llm.engine, llm.engine.core
    try:
        expected = llm.generate([[9, 9, 9]], GREEDY)[0].outputs[0].token_ids
        engine.add_request("x", [5, 6, 7], LONG)
        deadline = time.monotonic() + 30
        while not _unread_update_of(core, "x") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _unread_update_of(core, "x"), "the replica sent no update in 30 s"
        # the first x's updates are waiting, unread, when it is aborted and its id reused
        engine.abort_request("x")
        engine.add_request("x", [9, 9, 9], GREEDY)
        out = _run_to_end(engine)["x"]
        assert out.error is None and out.outputs[0].token_ids == expected
    finally:
        llm.shutdown()


def test_one_engine_gives_a_reused_id_its_own_tokens(one_engine):
    """Without replicas an abort takes effect at once: the id added again, before the next step, starts clean
    (its seeded sampling too)."""
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
    one_engine.add_request("y", [5, 6, 7], SamplingParams(temperature=0.8, seed=1, max_tokens=50, ignore_eos=True))
    one_engine.step()
    one_engine.abort_request("y")
    one_engine.add_request("y", [9, 9, 9], seeded)
    again = _run_to_end(one_engine)["y"].outputs[0].token_ids
    one_engine.add_request("z", [9, 9, 9], seeded)
    assert again == _run_to_end(one_engine)["z"].outputs[0].token_ids and len(again) == 6


# ---- C: an LLM dropped without shutdown() ----------------------------------------------------------------------
@needs_two_cores
def test_a_dropped_data_parallel_llm_stops_its_replica_processes(tiny_model_factory):
    llm = LLM(tiny_model_factory("llama"), data_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    assert llm.generate([[5, 6, 7]], GREEDY)[0].error is None
    pids = [r.link.pid for r in llm.engine.core.replicas]
    del llm
    gc.collect()
    assert all(process_ended_within(pid, 15) for pid in pids), "a replica process outlived its LLM"


def test_an_update_of_a_request_the_front_aborted_is_dropped_not_fatal():
    """compact_updates: a request with no serial (its abort popped it) gives no update and no KeyError; the
    others keep their serials, a finished one's is forgotten."""
    from tokenmill.engine.engine_core import CoreUpdate
    from tokenmill.engine.replica_links import compact_updates
    running, finished, aborted = Request("a", [5, 6], GREEDY), Request("b", [5, 7], GREEDY), Request("c", [5], GREEDY)
    finished.status = aborted.status = RequestStatus.FINISHED
    serials = {"a": 3, "b": 4}
    out = compact_updates([CoreUpdate(r, [9], []) for r in (running, aborted, finished)], serials)
    assert [(u.request_id, u.serial) for u in out] == [("a", 3), ("b", 4)]
    assert serials == {"a": 3}
