"""Tensor parallelism over the mp executor on this CPU (gloo): TP=2 gives TP=1's greedy tokens and, in
float32, its log-probabilities to 1e-5, on tiny models (even and uneven head splits, q/k/v bias, tied
head, chunked prefill with a prefix hit) and on the default model (fp32 to its float noise, and int4;
GGUF read in part per rank); a worker killed mid-generation fails the engine with a clear error instead of a hang; more ranks
than cores fail at start-up."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.executor import ExecutorFailed

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
PROMPTS = [[11, 220, 4890, 17, 9, 300], [7, 8, 9], [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000, 5]]
needs_two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")


def _run(model, tp: int, **kw):
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_bytes=1 << 23, block_size=4, **kw)
    try:
        return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.shutdown()


def _assert_same(a, b, tol: float | None):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        if tol is not None:
            for lx, ly in zip(x.logprobs, y.logprobs):          # the sampled token and the top 5
                assert [t.token_id for t in lx.top] == [t.token_id for t in ly.top]
                for u, v in zip([lx.sampled, *lx.top], [ly.sampled, *ly.top]):
                    assert abs(u.logprob - v.logprob) <= tol


@needs_two_cores
@pytest.mark.parametrize("arch,overrides", [
    ("llama", dict(tie_word_embeddings=True)),                                              # 2 kv heads: 1 + 1
    ("qwen2", dict(tie_word_embeddings=False, num_attention_heads=6, num_key_value_heads=3, hidden_size=96)),  # 2 + 1
])
def test_tp2_matches_tp1_on_tiny_models(tiny_model_factory, arch, overrides):
    model = tiny_model_factory(arch, **overrides)
    kw = dict(max_num_batched_tokens=7)                       # chunked prefill; prompt 3 hits prompt 1's prefix
    _assert_same(_run(model, 1, **kw), _run(model, 2, **kw), tol=1e-5)


@needs_two_cores
@pytest.mark.slow
@pytest.mark.parametrize("quantization,tol", [(None, 1e-4), ("int4", None)])
def test_tp2_matches_tp1_on_the_default_model(quantization, tol):
    """1e-4: the default model's float32 noise (30 layers, a few hidden dimensions tens of times larger than
    the rest). Measured here: TP=2 vs TP=1 3.0e-5, TP=1 vs transformers 8.2e-5 on these prompts."""
    _assert_same(_run(None, 1, quantization=quantization), _run(None, 2, quantization=quantization), tol)


@needs_two_cores
def test_a_killed_worker_fails_the_engine_clearly_and_quickly(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 23, block_size=4)
    failure: list[BaseException] = []

    def generate():
        try:       # 3 + 500 tokens of the tiny model's 512 positions: hundreds of steps, well past the kill below
            llm.generate([[5, 6, 7]] * 4, SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            failure.append(e)
    thread = threading.Thread(target=generate)
    thread.start()
    scheduler = llm.engine.core.scheduler
    deadline = time.monotonic() + 30
    while not any(r.num_output_tokens for r in list(scheduler.running)):   # kill mid-generation, not by the clock
        assert thread.is_alive() and time.monotonic() < deadline, "generation never started"
        time.sleep(0.001)
    victim = llm.engine.core.executor.procs[1]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    thread.join(30)
    assert not thread.is_alive(), "generate hung after a worker died"
    assert time.monotonic() - killed_at < 10
    assert failure and isinstance(failure[0], ExecutorFailed)
    assert f"rank 1 (pid {victim.pid}) died" in str(failure[0])
    assert all(not p.is_alive() for p in llm.engine.core.executor.procs)     # the other rank was stopped


def test_more_ranks_than_cores_fail_at_start_up(tiny_model_dir):
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"{cores + 1} tensor-parallel ranks need a CPU core each; this process may use {cores}"):
        LLM(tiny_model_dir, tensor_parallel_size=cores + 1, kv_cache_memory_bytes=1 << 22)


def test_tensor_parallel_needs_worker_processes(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 needs a worker process per rank"):
        LLM(tiny_model_dir, tensor_parallel_size=2, distributed_executor_backend="uni")


@needs_two_cores
def test_ray_backend_on_a_local_cluster(tiny_model_factory):
    pytest.importorskip("ray")
    model = tiny_model_factory("qwen2", tie_word_embeddings=False, num_attention_heads=6, num_key_value_heads=3,
                               hidden_size=96)
    expected = _run(model, 1)
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray", kv_cache_memory_bytes=1 << 23,
              block_size=4, num_threads=2)
    try:
        _assert_same(expected, [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)], tol=1e-5)
        import ray
        ray.kill(llm.engine.core.executor.actors[1])                   # a rank dies: fatal, clearly, at once
        t0 = time.monotonic()
        with pytest.raises(ExecutorFailed, match="Ray actor of the model died"):
            llm.generate(PROMPTS[:1], PARAMS)
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()
