"""Worker and replica processes are owned by their parent (executor/owned_process.py): the SIGINT and SIGTERM
a terminal's Ctrl-C or a group stop sends to every process of the server's group leave them serving (the
server drains: it needs them); they are not in the server's process group; they exit cleanly when the engine
shuts down, and when their parent dies (SIGKILL) or exits without shutting the engine down.

os.killpg would reach pytest too (it shares the test's group), so the tests send the signals to each child
pid, which is what the group signal does to each member; tests/server/test_worker_signals.py sends a real
group signal to a server in a session of its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import process_ended_within
from tokenmill import LLM, SamplingParams

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two processes need two cores")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[11, 220, 4890, 17 + i, 9] for i in range(4)]
GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)   # a terminal's Ctrl-C; `kill -TERM -<pgid>`, systemd's stop


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _signal_like_a_group(pids: list[int]) -> None:
    """Each group signal to every pid, then time for a process that acts on them to have done so (it dies
    within milliseconds: KeyboardInterrupt in its pipe read, or SIGTERM's default action)."""
    for sig in GROUP_SIGNALS:
        for pid in pids:
            os.kill(pid, sig)
    time.sleep(1.0)


def _outside_our_group(pid: int) -> bool:
    return os.getpgid(pid) != os.getpgid(0) and os.getsid(pid) != os.getsid(0)


@needs_two_cores
def test_tensor_parallel_workers_serve_on_through_group_signals(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    procs = list(llm.engine.core.executor.procs)
    try:
        expected = _tokens(llm)
        _signal_like_a_group([p.pid for p in procs])
        assert [p.is_alive() for p in procs] == [True, True], [p.exitcode for p in procs]
        assert _tokens(llm) == expected                      # the workers still step, in step
        assert all(_outside_our_group(p.pid) for p in procs)  # and a real group signal misses them
    finally:
        llm.shutdown()
    assert [p.exitcode for p in procs] == [0, 0]            # ended by the shutdown command, not killed


@needs_two_cores
def test_data_parallel_replicas_serve_on_through_group_signals(tiny_model_dir):
    llm = LLM(tiny_model_dir, data_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    links = [r.link for r in llm.engine.core.replicas]
    try:
        expected = _tokens(llm)
        _signal_like_a_group([link.pid for link in links])
        assert [link.proc.is_alive() for link in links] == [True, True], [link.proc.exitcode for link in links]
        assert _tokens(llm) == expected
        assert all(r.alive for r in llm.engine.core.replicas)
        assert all(_outside_our_group(link.pid) for link in links)
    finally:
        llm.shutdown()
    assert [link.proc.exitcode for link in links] == [0, 0]


_PARENT = """
import sys, time
from tokenmill import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
print(*[p.pid for p in llm.engine.core.executor.procs], flush=True)
if sys.argv[2] == "killed":
    time.sleep(600)
"""                                                 # "exits": without llm.shutdown()


@needs_two_cores
@pytest.mark.parametrize("parent_end", ["killed", "exits"])
def test_workers_end_with_their_parent(tiny_model_dir, parent_end):
    """Out of the parent's group, its workers must still end with it: SIGKILLed (they notice its death), or
    exiting without shutdown (it kills them before multiprocessing joins them: they ignore its SIGTERM)."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, tiny_model_dir, parent_end], stdout=subprocess.PIPE,
                              text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, f"the parent did not start its workers (exit code {parent.poll()})"
        if parent_end == "killed":
            parent.kill()
        assert parent.wait(30) in (0, -signal.SIGKILL)
        assert all(process_ended_within(pid, 30) for pid in pids), "a worker outlived its parent"
    finally:
        parent.kill()
        parent.wait()
