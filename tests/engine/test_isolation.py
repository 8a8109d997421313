"""One request never harms another, in process: a request that breaks its step, samples an impossible token
or breaks its own output processing fails alone; batch-mates get the tokens they get alone; parameters the
engine cannot compute are refused before anything is queued; the async loop survives callers that vanish
at any moment and, when it does die, says so to everyone."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.errors import EngineDeadError, RequestFailedError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
PROMPTS = ["one request", "another request", "a third one", "and a fourth"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20, block_size=8)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's tokens when it runs by itself, greedy and seeded."""
    return {(p, kind): llm.generate([p], sp)[0].outputs[0].token_ids
            for p in PROMPTS for kind, sp in (("greedy", GREEDY), ("seeded", SEEDED))}


POISON = "poison pill"


@pytest.fixture(params=["before", "after"])
def poison_breaks_its_step(request, llm, monkeypatch):
    """A step that holds a request whose prompt contains POISON raises, as a request-specific kernel fault
    would: before computing anything, or after the whole step was computed and sampled (so the retry must
    find the random generators as they were). The same step without it runs normally."""
    runner = llm.engine.core.runner
    real = runner._execute

    def execute(sched_out):
        poisoned = any(POISON in llm.tokenizer.decode(list(sr.prompt_token_ids)) for sr in sched_out.scheduled)
        if poisoned and request.param == "before":
            raise RuntimeError("kernel fault")
        out = real(sched_out)
        if poisoned:
            raise RuntimeError("kernel fault")
        return out
    monkeypatch.setattr(runner, "_execute", execute)


def _check_idle(llm):
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_used_blocks == 0


def test_a_request_that_breaks_its_step_fails_alone(llm, alone, poison_breaks_its_step):
    batch = PROMPTS[:2] + [POISON] + PROMPTS[2:]
    params = [GREEDY, SEEDED, GREEDY, GREEDY, SEEDED]
    with pytest.raises(RequestFailedError, match=r"prompt 2: .*kernel fault"):
        llm.generate(batch, params)
    _check_idle(llm)
    # the same, one request at a time through the engine, to see what the others got
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(batch, params)):
        engine.add_request(f"iso-{i}", p, sp)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    bad = finals.pop("iso-2")
    assert bad.error and "kernel fault" in bad.error and bad.outputs[0].finish_reason == "error"
    for i, (p, sp) in enumerate(zip(batch, params)):
        if i != 2:
            kind = "seeded" if sp is SEEDED else "greedy"
            assert finals[f"iso-{i}"].outputs[0].token_ids == alone[(p, kind)], p
            assert finals[f"iso-{i}"].error is None
    assert engine.stats().num_failed_requests_total >= 2
    _check_idle(llm)


def test_engine_is_usable_after_a_failure(llm, alone, poison_breaks_its_step):
    with pytest.raises(RequestFailedError):
        llm.generate([POISON], GREEDY)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == alone[(PROMPTS[0], "greedy")]
    _check_idle(llm)


def test_out_of_vocabulary_sample_never_reaches_the_cache(llm, alone, monkeypatch):
    runner = llm.engine.core.runner
    real = runner.sampler.__call__
    vocab = llm.engine.config.model.vocab_size

    target = llm.tokenizer.encode(PROMPTS[1])

    class Broken:   # the sampler returns an impossible id for PROMPTS[1]'s row
        generator = runner.sampler.generator

        def __call__(self, logits, metas):
            out = real(logits, metas)
            for i, m in enumerate(metas):
                if list(m.prompt_token_ids) == target:
                    out.token_ids[i] = vocab + 7
            return out
    monkeypatch.setattr(runner, "sampler", Broken())
    monkeypatch.setattr(runner, "greedy_head", None)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"oov-{i}", p, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "outside the vocabulary" in finals["oov-1"].error
    assert finals["oov-0"].outputs[0].token_ids == alone[(PROMPTS[0], "greedy")]
    assert finals["oov-2"].error is None and len(finals["oov-2"].outputs[0].token_ids) == 8
    _check_idle(llm)


def test_failed_request_leaves_nothing_in_the_prefix_cache(llm, poison_breaks_its_step):
    pool = llm.engine.core.kv.pool
    before = dict(pool.cached)
    with pytest.raises(RequestFailedError):
        llm.generate([POISON * 8], GREEDY)      # several full blocks, registered when scheduled
    assert set(pool.cached) <= set(before)
    _check_idle(llm)


def test_output_processing_failure_fails_that_request_alone(llm, alone, monkeypatch):
    from tokenmill.engine import llm_engine
    real = llm_engine.IncrementalDetokenizer.append

    def append(self, ids):
        if getattr(self, "poisoned", False):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken detokenizer")
        return real(self, ids)
    monkeypatch.setattr(llm_engine.IncrementalDetokenizer, "append", append)
    engine = llm.engine
    engine.add_request("ok", PROMPTS[0], GREEDY)
    engine.add_request("broken", PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, n=2))
    for c in engine.requests["broken"].completions:
        c.detok.poisoned = True
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "broken detokenizer" in finals["broken"].error
    assert [o.finish_reason for o in finals["broken"].outputs] == ["error", "error"]
    assert finals["ok"].outputs[0].token_ids == alone[(PROMPTS[0], "greedy")]
    _check_idle(llm)


@pytest.mark.parametrize("kwargs,field_name", [
    (dict(top_k=2**63), "top_k"),
    (dict(top_k=10**6), "top_k"),
    (dict(temperature=1e300), "temperature"),
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(49152)), min_tokens=2), "stop_token_ids"),   # past the cap of 1,024 ids
])
def test_parameters_the_engine_cannot_compute_are_refused_and_nothing_is_queued(llm, kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        llm.generate(["fine", "also fine", "the bad one"],
                     [GREEDY, GREEDY, SamplingParams(max_tokens=4, **kwargs)])
    _check_idle(llm)


def test_a_failed_batch_submission_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(["fine", "fine too", [10**9]], GREEDY)
    _check_idle(llm)
    llm.engine.add_request("x", "taken", SamplingParams(max_tokens=2, n=2))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("x#0", "clashes with a child of x", GREEDY)
    llm.engine.abort_request("x")
    _check_idle(llm)


def test_stream_raises_for_its_failed_request(llm, poison_breaks_its_step):
    with pytest.raises(RequestFailedError, match="kernel fault"):
        list(llm.stream(POISON, GREEDY))
    _check_idle(llm)


# ---- the async loop -------------------------------------------------------------------------------
@pytest.fixture
def async_engine(llm, alone):     # after `alone`: only one thread may drive the engine at a time
    engine = AsyncEngine(engine=llm.engine)
    yield engine
    engine.shutdown()


async def _collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


def test_callers_that_vanish_at_any_moment_never_kill_the_loop(llm, alone, async_engine):
    async def run():
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        # cancelled while its add is queued or being admitted
        for i in range(20):
            task = asyncio.ensure_future(_collect(async_engine, PROMPTS[0], long, f"gone-{i}"))
            for _ in range(i % 4):
                await asyncio.sleep(0)
            task.cancel()
        # cancelled after a few outputs (mid-stream), and after the last one
        agen = async_engine.generate(PROMPTS[1], long, "mid")
        await anext(agen)
        await agen.aclose()
        done = await _collect(async_engine, PROMPTS[2], GREEDY, "after")
        assert done[-1].finished
        await async_engine.abort("after")
        return await _collect(async_engine, PROMPTS[0], GREEDY, "check")
    outs = asyncio.run(run())
    assert outs[-1].outputs[0].token_ids == alone[(PROMPTS[0], "greedy")]
    assert async_engine.dead is None
    deadline = asyncio.run(_wait_idle(async_engine))
    assert deadline and llm.engine.stats().num_used_blocks == 0


async def _wait_idle(engine, timeout_s=10.0):
    for _ in range(int(timeout_s / 0.05)):
        if not engine.engine.has_unfinished_requests() and engine.num_unfinished == 0:
            return True
        await asyncio.sleep(0.05)
    return False


def test_async_failed_request_raises_to_its_caller_only(alone, poison_breaks_its_step, async_engine):
    async def run():
        return await asyncio.gather(_collect(async_engine, POISON, GREEDY, "bad"),
                                    _collect(async_engine, PROMPTS[0], GREEDY, "good"), return_exceptions=True)
    bad, good = asyncio.run(run())
    assert isinstance(bad, RequestFailedError) and "kernel fault" in str(bad)
    assert good[-1].outputs[0].token_ids == alone[(PROMPTS[0], "greedy")]
    assert async_engine.dead is None


def test_a_dead_loop_fails_everything_and_says_so(llm, alone, monkeypatch):
    engine = AsyncEngine(engine=llm.engine)
    died = threading.Event()
    engine.on_dead(lambda error: died.set())
    monkeypatch.setattr(llm.engine.core.scheduler, "schedule", lambda: 1 / 0)

    async def run():
        first = await asyncio.gather(_collect(engine, PROMPTS[0], GREEDY, "a"),
                                     _collect(engine, PROMPTS[1], GREEDY, "b"), return_exceptions=True)
        later = await asyncio.gather(_collect(engine, PROMPTS[2], GREEDY, "c"), return_exceptions=True)
        return first + later
    try:
        results = asyncio.run(asyncio.wait_for(run(), 30))
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "ZeroDivisionError" in str(results[0])
        assert died.wait(5) and engine.died_of_bug and engine.dead is not None
    finally:
        monkeypatch.undo()
        engine.shutdown()
        for rid in list(llm.engine.requests):
            llm.engine.abort_request(rid)


def _blocks_written(sr, block_size: int) -> set[int]:
    """The blocks whose KV the step writes for one scheduled request: those of its new positions."""
    last = sr.start_position + len(sr.token_ids) - 1
    return set(sr.block_ids[sr.start_position // block_size:last // block_size + 1])


def test_a_request_of_a_failed_step_never_reads_kv_its_failed_batch_mate_was_to_write(tiny_model_dir, monkeypatch):
    """A and B share an 8-token prompt (2 blocks of 4); the forward pass raises whenever A is in a step,
    before computing anything. A fails; B gets the tokens it gets alone (none read from a block A was to
    write), and every block left in the prefix cache holds KV that a step which succeeded wrote."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    reference = LLM(tiny_model_dir, kv_cache_memory_bytes=1 << 20, block_size=4, enable_prefix_caching=False)
    alone_b = reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
    llm = LLM(tiny_model_dir, kv_cache_memory_bytes=1 << 20, block_size=4)
    runner, written = llm.engine.core.runner, set()
    real = runner._execute

    def execute(sched_out):
        if any(sr.request_id == "A" for sr in sched_out.scheduled):
            raise RuntimeError("kernel fault")
        out = real(sched_out)
        for sr in sched_out.scheduled:
            written.update(_blocks_written(sr, 4))
        return out
    monkeypatch.setattr(runner, "_execute", execute)
    engine = llm.engine
    engine.add_request("A", prompt, GREEDY)
    engine.add_request("B", prompt, GREEDY)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "kernel fault" in finals["A"].error
    assert finals["B"].error is None and finals["B"].outputs[0].token_ids == alone_b
    cached = {block.block_id for block in engine.core.kv.pool.cached.values()}
    assert cached and cached <= written
    _check_idle(llm)
