"""MoE models across two ranks of the mp executor on this CPU (gloo): experts split across the ranks
(tensor parallel) and whole experts per rank with all-to-all dispatch (expert parallel) give one rank's
greedy tokens, log-probabilities to 1e-5 and expert token counts; MLA heads split across ranks; gpt-oss's
sinks split with its heads and its row-parallel biases (o_proj, experts' down_proj) added once."""
from __future__ import annotations

import os

import pytest

from tokenmill import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
PROMPTS = [[11, 220, 4890, 17, 9, 300], [7, 8, 9], [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000]]
pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")


def _run(model, tp: int, ep: bool = False):
    llm = LLM(model, tensor_parallel_size=tp, enable_expert_parallel=ep, kv_cache_memory_bytes=1 << 23,
              block_size=4, max_num_batched_tokens=7)         # chunked prefill; prompt 3 hits prompt 1's prefix
    try:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS)]
        return outs, llm.engine.stats().expert_tokens
    finally:
        llm.shutdown()


def _assert_same(a, b, tol=1e-5):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert [t.token_id for t in lx.top] == [t.token_id for t in ly.top]
            for u, v in zip([lx.sampled, *lx.top], [ly.sampled, *ly.top]):
                assert abs(u.logprob - v.logprob) <= tol


def test_deepseek_v3_split_experts_and_heads_match_one_rank(tiny_model_factory):
    model = tiny_model_factory("deepseek_v3")
    one, counts = _run(model, 1)
    two, two_counts = _run(model, 2)
    _assert_same(one, two)
    assert two_counts == counts


def test_mixtral_expert_parallel_matches_one_rank(tiny_model_factory):
    model = tiny_model_factory("mixtral", num_local_experts=5)      # uneven: 3 experts on rank 0, 2 on rank 1
    one, counts = _run(model, 1)
    two, two_counts = _run(model, 2, ep=True)
    _assert_same(one, two)
    assert two_counts == counts


@pytest.mark.parametrize("ep", [False, True], ids=["split-experts", "expert-parallel"])
def test_gpt_oss_across_two_ranks_matches_one_rank(tiny_model_factory, ep):
    model = tiny_model_factory("gpt_oss")          # a window of 4 on layer 0, sinks, biases everywhere
    one, counts = _run(model, 1)
    two, two_counts = _run(model, 2, ep=ep)
    _assert_same(one, two)
    assert two_counts == counts
