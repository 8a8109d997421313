"""Speculative decoding in the engine (n-gram drafts): greedy outputs identical to no speculation on tiny
models (prompts that repeat, so drafts are accepted) across block boundaries, under preemption, with prefix
hits, through the mp executor's deltas, with stop strings and max_tokens landing inside an accepted run;
seeded sampling repeats and gives the tokens it gives without speculation; every block is free afterwards; the counters and mean acceptance length."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
PATTERN = [101, 202, 303, 404, 505, 606, 707]
PROMPTS = [PATTERN * 4, [11, 12, 13] * 6 + [14], [7, 8, 9, 10, 11] * 3, [42] * 9]


def _llm(model, spec, **kw):
    kw.setdefault("kv_cache_memory_bytes", 1 << 23)
    return LLM(model, block_size=4, enable_prefix_caching=kw.pop("prefix", False), speculative_config=spec, **kw)


def _tokens(llm, prompts=PROMPTS, params=None):
    params = params or SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculation_gives_the_same_tokens(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    plain = _tokens(_llm(model, None))
    llm = _llm(model, SPEC)
    assert _tokens(llm) == plain
    stats = llm.engine.stats()
    assert stats.spec_decode.num_drafts > 0 and stats.num_used_blocks == 0
    if stats.spec_decode.num_accepted_tokens == 0:
        pytest.skip("the random tiny model accepted no draft here")      # equality above still held


def test_speculation_under_preemption_and_with_prefix_hits(tiny_model_factory):
    model = tiny_model_factory("llama")
    plain = _tokens(_llm(model, None))
    tight = _llm(model, SPEC, kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * 4 * 24)      # 24 blocks of 4
    assert _tokens(tight) == plain
    assert tight.engine.core.scheduler.num_preemptions_total > 0
    cached = _llm(model, SPEC, prefix=True)
    assert _tokens(cached) == plain and _tokens(cached) == plain          # the second run hits the cache
    assert cached.engine.stats().prefix_cache_hits_total > 0


def test_speculation_through_the_mp_executor(tiny_model_factory):
    model = tiny_model_factory("llama")
    plain = _tokens(_llm(model, None))
    llm = _llm(model, SPEC, distributed_executor_backend="mp")
    try:
        assert _tokens(llm) == plain
        assert llm.engine.core.decode_rows == _llm(model, SPEC).engine.core.decode_rows     # the worker's rows
    finally:
        llm.shutdown()


def test_stop_strings_and_max_tokens_inside_an_accepted_run(tiny_model_factory):
    model = tiny_model_factory("llama")
    base, spec = _llm(model, None), _llm(model, SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = base.generate(PROMPTS, params)
    for out in full:
        text = out.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        if not stop.strip():
            continue
        p = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        a = base.generate([out.prompt_token_ids], p)[0].outputs[0]
        b = spec.generate([out.prompt_token_ids], p)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    for max_tokens in (1, 2, 3, 5, 7):                                   # lands anywhere in a run of 5
        p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert _tokens(spec, params=p) == _tokens(base, params=p)


def test_seeded_sampling_with_speculation_repeats(tiny_model_factory):
    llm = _llm(tiny_model_factory("llama"), SPEC)
    params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=5)
    assert _tokens(llm, params=params) == _tokens(llm, params=params)


def test_seeded_sampling_gives_the_same_tokens_with_or_without_speculation(tiny_model_factory):
    model = tiny_model_factory("llama")
    # top-2 keeps the random tiny model's samples on its greedy cycles often enough for n-gram drafts to
    # be right sometimes and wrong sometimes
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=24, ignore_eos=True, seed=5)
    plain = _tokens(_llm(model, None), params=params)
    for k in (4, 2):
        llm = _llm(model, {"method": "ngram", "num_speculative_tokens": k, "adaptive": False})
        assert _tokens(llm, params=params) == plain, k
        spec = llm.engine.stats().spec_decode
        assert spec.num_draft_tokens > spec.num_accepted_tokens > 0


def test_counters_and_mean_acceptance_length(tiny_model_factory):
    llm = _llm(tiny_model_factory("llama"), SPEC)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens >= spec.num_accepted_tokens >= 0
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert all(a >= b for a, b in zip(spec.accepted_per_position, spec.accepted_per_position[1:]))
    m = [o.outputs[0].metrics for o in outs]
    assert sum(x.num_spec_steps for x in m) == spec.num_drafts
    assert all(x.mean_acceptance_length is None or 1 <= x.mean_acceptance_length <= 5 for x in m)


def test_bad_speculative_configs_are_refused(tiny_model_dir):
    for bad, match in [({"method": "eagle9", "num_speculative_tokens": 2}, "unknown method 'eagle9'"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
                       ({"method": "ngram"}, r"missing \['num_speculative_tokens'\]"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown keys \['k'\]"),
                       ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=match):
            LLM(tiny_model_dir, speculative_config=bad, kv_cache_memory_bytes=1 << 22)


def test_fixed_and_adaptive_draft_lengths(tiny_model_factory):
    model = tiny_model_factory("llama")
    fixed = _llm(model, {**SPEC, "adaptive": False})
    adaptive = _llm(model, SPEC)
    assert _tokens(fixed) == _tokens(adaptive)
    assert fixed.engine.core.draft_length is None and adaptive.engine.core.draft_length is not None
    assert 0 <= adaptive.engine.core.draft_length.last_k <= 4


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_default_model_speculates_losslessly(quantization):
    article = ("The old lighthouse keeper climbed the stairs every evening. The old lighthouse keeper lit the lamp "
               "every evening. Ships passed the rocks safely because the old lighthouse keeper lit the lamp. ") * 3
    prompts = [f"Summarize: {article}\nSummary:", "Repeat after me: red, green, blue, red, green, blue, red, green,"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs = []
    for spec in (None, {**SPEC, "adaptive": False}):
        llm = LLM(quantization=quantization, speculative_config=spec, kv_cache_memory_bytes=1 << 26,
                  enable_prefix_caching=False)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if spec:
            assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_relaxed_acceptance_accepts_at_least_as_much(tiny_model_factory):
    model = tiny_model_factory("llama")
    strict = _llm(model, {**SPEC, "adaptive": False})
    relaxed = _llm(model, {**SPEC, "adaptive": False, "acceptance": "relaxed", "relaxed_top_n": 4,
                           "relaxed_delta": 0.5})
    _tokens(strict), _tokens(relaxed)
    a, b = strict.engine.stats().spec_decode, relaxed.engine.stats().spec_decode
    assert b.num_accepted_tokens / b.num_draft_tokens >= a.num_accepted_tokens / a.num_draft_tokens


def test_the_scheduler_measures_what_speculative_steps_yield(tiny_model_factory):
    from tokenmill.core.decode_yield import DecodeYieldMeter
    llm = _llm(tiny_model_factory("llama"), {**SPEC, "adaptive": False}, scheduling_policy="slo")
    core = llm.engine.core
    assert core.scheduler.decode_yield is not None and _llm(tiny_model_factory("llama"), None).engine.core \
        .scheduler.decode_yield is None                             # measured only with speculation
    core.scheduler.decode_yield = DecodeYieldMeter(decay=1.0)       # plain means, to compare with the counters
    _tokens(llm)
    decoded = len(PROMPTS) * 23                                     # each prompt's first token is its prefill's
    accepted = core.scheduler.spec_stats.num_accepted_tokens      # counted where the meter records
    y = core.scheduler.decode_yield.current
    assert accepted > 0
    assert y.output_tokens == pytest.approx(decoded / (decoded - accepted))   # tokens per decoding step
    assert y.new_tokens > y.output_tokens                           # every accepted draft was computed, and more
    assert llm.engine.step_time_model()["decode_yield"]["output_tokens"] == pytest.approx(y.output_tokens)
