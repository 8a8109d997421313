"""The LLM API as vLLM users call it: prompt dicts ({"prompt": ...}, {"prompt_token_ids": [...]}), the chat
output's rendered prompt, cumulative_logprob, boolean parameters that must be booleans, numpy numbers and
token ids taken as Python ints."""
from __future__ import annotations

import math

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.outputs import CompletionOutput, Logprob, TokenLogprobs

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, kv_cache_memory_bytes=8 << 20, block_size=8)


def test_prompt_dicts_as_vllm(llm):
    ids = llm.tokenizer.encode("hello there")
    plain = llm.generate(["hello there"], GREEDY)[0]
    by_ids = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    by_text = llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": ids}], GREEDY)
    assert by_ids.prompt_token_ids == ids and by_ids.prompt is None
    assert [o.outputs[0].token_ids for o in (by_ids, *by_text)] == [plain.outputs[0].token_ids] * 3
    assert by_text[0].prompt == "hello there"
    streamed = list(llm.stream({"prompt_token_ids": ids}, GREEDY))
    assert streamed[-1].outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="unsupported prompt keys"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, GREEDY)
    with pytest.raises(ValueError, match="needs 'prompt'"):
        llm.generate([{}], GREEDY)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": 5}, GREEDY)


def test_chat_output_carries_rendered_prompt(llm):
    conv = [{"role": "user", "content": "hi"}]
    out = llm.chat(conv, GREEDY)[0]
    text = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text
    assert out.prompt_token_ids == llm.apply_chat_template(conv)


def test_cumulative_logprob(llm):
    out = llm.generate("hi", SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True))[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(t.sampled.logprob for t in out.logprobs))
    assert out.cumulative_logprob <= 0 and math.isfinite(out.cumulative_logprob)
    assert llm.generate("hi", GREEDY)[0].outputs[0].cumulative_logprob is None
    c = CompletionOutput(0, "", [1, 2], logprobs=[TokenLogprobs(Logprob(1, -0.5), []),
                                                  TokenLogprobs(Logprob(2, -1.25), [])])
    assert c.cumulative_logprob == -1.75


@pytest.mark.parametrize("name", ["ignore_eos", "include_stop_str_in_output", "skip_special_tokens"])
@pytest.mark.parametrize("value", ["false", None, 0, 1])
def test_boolean_parameters_must_be_bools(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    assert getattr(SamplingParams(**{name: True}), name) is True


def test_numpy_scalars_accepted_as_numbers():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(5), n=np.int32(2),
                        seed=np.int64(3), max_tokens=np.int64(8), logprobs=np.int64(1),
                        stop_token_ids=[np.int64(7)])
    assert (sp.temperature, sp.top_k, sp.n, sp.seed, sp.max_tokens, sp.stop_token_ids) == (0.5, 5, 2, 3, 8, (7,))
    assert type(sp.top_k) is int and type(sp.temperature) is float and type(sp.stop_token_ids[0]) is int
    for bad in (dict(temperature=np.float32("nan")), dict(top_k=np.int64(-3)), dict(n=np.bool_(True)),
                dict(top_p=np.float64("inf"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_numpy_token_ids_in_prompts(llm):
    np = pytest.importorskip("numpy")
    ids = llm.tokenizer.encode("hello there")
    want = llm.generate([ids], GREEDY)[0].outputs[0].token_ids
    single = llm.generate([np.int64(t) for t in ids], GREEDY)
    batch = llm.generate([[np.int32(t) for t in ids], {"prompt_token_ids": [np.int64(t) for t in ids]}], GREEDY)
    assert len(single) == 1 and single[0].prompt_token_ids == ids
    assert [o.outputs[0].token_ids for o in (*single, *batch)] == [want] * 3
    with pytest.raises(TypeError):
        llm.generate([[True, 1]], GREEDY)
