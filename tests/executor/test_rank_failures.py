"""A rank's failure during a step with several tensor-parallel ranks (executor/mp.py, ray_executor.py): its
error is fatal to the executor at once (the other ranks may be waiting in a collective it never reached),
with the rank's message, and every worker is stopped; an error or death of another rank seen by then is
named too (an error that came first survives the death that follows it). With one rank a step's error
stays the step's (the engine core bisects it to a request).

The unit tests drive a MultiprocExecutor over real pipes to stand-in processes; the last two run two real
ranks on the tiny model (worker processes, Ray actors), one of which is sent a step it cannot decode."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.messages import SchedulerOutput
from tokenmill.executor import ExecutorFailed
from tokenmill.executor.messages import DeltaEncoder, ScheduledDelta, StepDelta
from tokenmill.executor.mp import MultiprocExecutor

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two cores")


class _StandInProcess:
    def __init__(self, pid: int, alive: bool, exitcode: int | None = None) -> None:
        self.pid, self.alive, self.exitcode = pid, alive, exitcode

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        self.alive = False


def _executor(procs: list[_StandInProcess]) -> tuple[MultiprocExecutor, list]:
    """An executor over real pipes to `procs`; returns it and the workers' ends of the pipes."""
    executor = object.__new__(MultiprocExecutor)
    ends = [multiprocessing.Pipe() for _ in procs]
    executor.procs, executor.conns = procs, [ours for ours, _ in ends]
    executor.encoder, executor._closed = DeltaEncoder(), False
    executor.step_timeout_s = 30.0
    return executor, [theirs for _, theirs in ends]


@pytest.mark.parametrize("rank0", ["closed before the step", "dead during the step"])
def test_a_ranks_error_survives_another_ranks_death(rank0):
    procs = [_StandInProcess(100, alive=False, exitcode=-6), _StandInProcess(101, alive=True)]
    executor, workers = _executor(procs)
    workers[1].send(("error", "injected OOM"))
    if rank0 == "closed before the step":
        workers[0].close()
    with pytest.raises(ExecutorFailed) as failure:
        executor.execute(SchedulerOutput([]))
    assert "rank 1: injected OOM" in str(failure.value)
    assert executor._closed and not procs[1].alive


def test_with_two_ranks_an_error_is_fatal_at_once():
    """Rank 0 is still in the step (in a real group: in a collective rank 1 never reached)."""
    procs = [_StandInProcess(100, alive=True), _StandInProcess(101, alive=True)]
    executor, workers = _executor(procs)
    workers[1].send(("error", "IndexError: index out of range"))
    t0 = time.monotonic()
    with pytest.raises(ExecutorFailed, match=r"rank 1 failed during 'step': IndexError: index out of range"):
        executor.execute(SchedulerOutput([]))
    assert time.monotonic() - t0 < executor.step_timeout_s            # not after waiting out rank 0
    assert executor._closed and not any(p.alive for p in procs)
    assert workers[0].recv() == ("step", executor.encoder.encode(SchedulerOutput([])))
    assert workers[0].recv() == ("shutdown",)                        # rank 0 was told to stop too


def test_a_killed_rank_is_named_when_its_peers_broken_collective_answers_first():
    procs = [_StandInProcess(100, alive=True), _StandInProcess(101, alive=False, exitcode=-9)]
    executor, workers = _executor(procs)
    workers[0].send(("error", "RuntimeError: gloo: Connection closed by peer"))
    with pytest.raises(ExecutorFailed) as failure:
        executor.execute(SchedulerOutput([]))
    assert "rank 0 failed during 'step': RuntimeError: gloo: Connection closed by peer" in str(failure.value)
    assert "rank 1 (pid 101) died during 'step' with exit code -9" in str(failure.value)


def test_with_one_rank_an_error_is_the_steps():
    executor, workers = _executor([_StandInProcess(100, alive=True)])
    workers[0].send(("error", "ValueError: bad input"))
    with pytest.raises(RuntimeError, match="ValueError: bad input") as failure:
        executor.execute(SchedulerOutput([]))
    assert not isinstance(failure.value, ExecutorFailed) and not executor._closed


# a step naming a request the rank never saw: the rank raises before its first collective, while the
# other ranks run the real step and wait for it there
_UNDECODABLE = StepDelta([ScheduledDelta("never-sent", 0, 1, True, [], [])])


class _UndecodableSteps:
    """A rank's pipe that replaces every step with _UNDECODABLE."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, message) -> None:
        self.conn.send(("step", _UNDECODABLE) if message[0] == "step" else message)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def _generate_in_a_thread(llm, timeout_s: float) -> list[BaseException]:
    """generate one prompt, on a thread joined for at most timeout_s (asserting it ended): its exception."""
    failure: list[BaseException] = []

    def generate():
        try:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            failure.append(e)
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "generate hung after a rank's step failed"
    return failure


@needs_two_cores
def test_a_rank_that_raises_mid_step_fails_the_engine_clearly(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    executor = llm.engine.core.executor
    executor.conns[1] = _UndecodableSteps(executor.conns[1])
    try:
        failure = _generate_in_a_thread(llm, 45)   # rank 0 waits in its all-reduce until it is stopped
        assert failure and isinstance(failure[0], ExecutorFailed), failure
        assert "rank 1 failed during 'step': KeyError: 'never-sent'" in str(failure[0])
        assert all(not p.is_alive() for p in executor.procs)
    finally:
        llm.shutdown()


@needs_two_cores
def test_a_ray_rank_that_raises_mid_step_fails_the_engine_clearly(tiny_model_dir):
    pytest.importorskip("ray")
    import ray
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
              kv_cache_memory_bytes=1 << 23, block_size=4, num_threads=2)
    executor = llm.engine.core.executor
    send_to_all = executor._call

    def call(command: str, *args):                 # as RayExecutor._call, rank 1 sent an undecodable step
        if command != "step":
            return send_to_all(command, *args)
        refs = [executor.actors[0].call.remote("step", *args), executor.actors[1].call.remote("step", _UNDECODABLE)]
        return executor._get(refs, "step", executor.step_timeout_s)
    executor._call = call
    try:
        failure = _generate_in_a_thread(llm, 45)   # rank 0 waits in its all-reduce until it is killed
        assert failure and isinstance(failure[0], ExecutorFailed), failure
        assert "rank failed during 'step': KeyError: 'never-sent'" in str(failure[0])
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(executor.actors[0].call.remote("weight_bytes"), timeout=30)
    finally:
        llm.shutdown()
