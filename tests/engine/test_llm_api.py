"""LLM API behaviour on a tiny random model: stops, n, logprobs, seeds, streaming, preemption, errors."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20, block_size=8)


def test_max_tokens_and_usage(llm):
    out = llm.generate(["hello there"], SamplingParams(max_tokens=7, ignore_eos=True, temperature=0))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 7 and c.finish_reason == "length"
    assert out.num_prompt_tokens == len(llm.tokenizer.encode("hello there"))
    m = c.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == 7


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate(["abc"], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0))[0].outputs[0]
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                               stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
        assert out.text == text[:text.index(stop)] and out.finish_reason == "stop" and out.stop_reason == stop


def test_n_completions_seeded_are_distinct_and_reproducible(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate(["tell me"], p)[0]
    b = llm.generate(["tell me"], p)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_seeded_request_same_tokens_whatever_its_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["seeded prompt"], p)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 15, 6)]
    batch = llm.generate(["x y z", "seeded prompt", "a much longer prompt with several words in it", "q"],
                         [others[0], p, others[1], others[2]])
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs(llm):
    out = llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, lp in zip(out.outputs[0].token_ids, lps):
        assert lp.sampled.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok   # greedy: the sampled token is the most likely
        assert lp.sampled.logprob <= 0


def test_stream_deltas_add_up(llm):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    pieces, ids, last = [], [], None
    for out in llm.stream("stream me", p):
        pieces.append(out.outputs[0].new_text)
        ids.extend(out.outputs[0].new_token_ids)
        last = out
    assert last.finished and "".join(pieces) == last.outputs[0].text
    assert ids == last.outputs[0].token_ids == llm.generate("stream me", p)[0].outputs[0].token_ids


def test_preemption_reproduces_uninterrupted_tokens(tiny_model_dir):
    prompts = [f"request number {i} with some words" for i in range(6)]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)] * 3 + \
             [SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0, seed=i) for i in range(3)]
    roomy = LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20, block_size=4).generate(prompts, params)
    # 512 bytes of KV per token: 14 blocks of 4 tokens hold one or two 47-token requests at a time
    tight = LLM(tiny_model_dir, block_size=4, kv_cache_memory_bytes=14 * 4 * 512)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]
    assert tight.engine.stats().num_used_blocks == 0


def test_bad_input_is_a_clear_error_and_loses_nothing(llm):
    with pytest.raises(ValueError, match="prompt tokens"):
        llm.generate([[5] * 100_000], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10 ** 9]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    out = llm.generate(["still works"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.engine.stats().num_used_blocks == 0 or llm.engine.config.cache.enable_prefix_caching


def test_abort_frees_blocks(llm):
    gen = llm.stream("abort me please", SamplingParams(max_tokens=50, ignore_eos=True))
    next(gen)
    gen.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_used_blocks == 0
