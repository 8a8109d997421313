"""SamplingParams validation: every bad value raises ValueError naming the field."""
import dataclasses
import math

import pytest

from tokenmill.sampling_params import MAX_LOGPROBS, SamplingParams

NAN = float("nan")

INVALID = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": NAN}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "0.5"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": NAN}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": 2}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": NAN}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": NAN}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("presence_penalty", {"presence_penalty": 3}),
    ("presence_penalty", {"presence_penalty": NAN}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": NAN}),
    ("seed", {"seed": "x"}),
    ("seed", {"seed": 1.0}),
    ("seed", {"seed": True}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": 3}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["a"]}),
    ("stop_token_ids", {"stop_token_ids": 7}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": True}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 10, "max_tokens": 5}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    ("logprobs", {"logprobs": -1}),
]


@pytest.mark.parametrize("field_name,kwargs", INVALID, ids=[f"{f}={k}" for f, k in INVALID])
def test_invalid_value_names_the_field(field_name, kwargs):
    with pytest.raises(ValueError, match=field_name):
        SamplingParams(**kwargs)


def test_defaults_are_valid():
    p = SamplingParams()
    assert p.n == 1 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.stop == () and p.stop_token_ids == () and p.max_tokens == 16 and p.logprobs is None
    assert not p.greedy and not p.has_penalties


def test_valid_edge_values_are_accepted():
    p = SamplingParams(temperature=0, top_p=1, top_k=1, min_p=1.0, repetition_penalty=0.5,
                       presence_penalty=-2, frequency_penalty=2, seed=-5, stop_token_ids=[0],
                       max_tokens=None, min_tokens=3, logprobs=MAX_LOGPROBS)
    assert p.greedy and p.has_penalties and p.stop_token_ids == (0,)


def test_stop_str_becomes_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_frozen_hashable_and_replace_validates():
    p = SamplingParams(stop=["x"], stop_token_ids=[1, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    assert hash(p) == hash(SamplingParams(stop=("x",), stop_token_ids=(1, 2)))
    assert p.replace(temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=2.0)


def test_min_tokens_that_no_token_could_satisfy_is_refused_for_the_model():
    params = SamplingParams(min_tokens=2, stop_token_ids=[0, 1, 2, 3, 4, 5, 6])
    params.check_for_model(vocab_size=8, eos_token_ids=[9])               # id 7 remains (EOS 9 is outside)
    with pytest.raises(ValueError, match=r"min_tokens \(2\) cannot be satisfied: .* all 8 tokens"):
        params.check_for_model(vocab_size=8, eos_token_ids=[7])
