"""The builder's OpenMP team is given back before another thread steps the engine (platforms/host_threads.py).

Thread counts are read from /proc in a fresh interpreter, so no other test's threads move them."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine import async_engine as async_engine_module
from tokenmill.platforms.host_threads import loaded_openmp_runtimes, release_thread_pool

needs_openmp_team = pytest.mark.skipif(
    not sys.platform.startswith("linux") or (os.cpu_count() or 1) < 2,
    reason="an OpenMP team of 2 threads and /proc are needed")

_CHILD = r"""
import os, time, torch
from tokenmill.platforms.host_threads import release_thread_pool
def threads():
    return len(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
x = torch.ones(1 << 22)
for _ in range(3):
    (x * 2.0).sum()                    # a parallel region: this thread's team of 2 now exists
before = threads()
released = release_thread_pool()
deadline = time.monotonic() + 5.0
while threads() >= before and time.monotonic() < deadline:
    time.sleep(0.01)
after = threads()
(x * 2.0).sum()                        # a new region makes a new team: nothing is broken
print(released, before, after, threads(), torch.get_num_threads())
"""


@needs_openmp_team
def test_release_frees_the_calling_threads_team_and_keeps_torch_working():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released, before, after, again, num_threads = map(int, out.stdout.split())
    assert released >= 1
    assert after == before - 1           # the team's one worker thread is gone
    assert again == before               # ... and comes back with the next parallel region
    assert num_threads == 2              # the thread-count setting survives the release


@needs_openmp_team
def test_torchs_openmp_runtime_is_found():
    (torch.ones(1 << 20) * 2.0).sum()
    assert loaded_openmp_runtimes(), "torch's OpenMP runtime should be mapped after a parallel region"


def test_release_is_harmless_inside_a_thread_without_a_team():
    results = []
    thread = threading.Thread(target=lambda: results.append(release_thread_pool()))
    thread.start()
    thread.join()
    assert results and results[0] >= 0
    assert torch.ones(4).sum().item() == 4.0


def test_async_engine_releases_the_builders_team_before_its_loop_starts(tiny_model_dir, monkeypatch):
    calls = []

    def spy():
        calls.append(threading.current_thread())
        return release_thread_pool()

    monkeypatch.setattr(async_engine_module, "release_thread_pool", spy)
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20, block_size=8)
    engine = async_engine_module.AsyncEngine(engine=llm.engine)
    try:
        assert calls == [threading.current_thread()]           # on the builder's thread, once
        async def one():
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            return [out async for out in engine.generate("hello", params, "r0")][-1]
        last = asyncio.run(one())
        assert last.finished and len(last.outputs[0].token_ids) == 4
    finally:
        engine.shutdown()
