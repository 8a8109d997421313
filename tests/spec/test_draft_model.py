"""The `draft_model` proposer: a separate draft model (its own cache in the pool) and self-speculation with
the target's first layers (sharing its layers and cache): greedy outputs equal no speculation through
chunked prefill and preemption, drafts proposed (the mp executor's path is test_mtp.py's); a self-draft as deep as the target drafts
exactly the target's tokens (all accepted); clear errors for a bad layer count or another vocabulary."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[11, 220, 4890, 17, 9, 300], [5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 220, 4890, 17, 9, 300, 44, 45]]


def _tokens(model, spec=None, prompts=PROMPTS, **kw):
    kw.setdefault("kv_cache_memory_bytes", 1 << 22)
    llm = LLM(model, block_size=4, speculative_config=spec, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_self_speculation_keeps_greedy_outputs(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    plain, _ = _tokens(model)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1, "adaptive": False}
    got, llm = _tokens(model, spec, max_num_batched_tokens=7)
    assert got == plain
    assert llm.engine.stats().spec_decode.num_draft_tokens > 0
    assert llm.engine.core.runner.drafter.attention_layers() == []        # the target's cache is shared


def test_a_separate_draft_model_keeps_greedy_outputs_under_preemption(tiny_model_factory):
    target = tiny_model_factory("llama", num_hidden_layers=3)
    draft = tiny_model_factory("llama", num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": draft, "adaptive": False}
    plain, _ = _tokens(target)
    probe = LLM(target, block_size=4, kv_cache_memory_bytes=1 << 22, speculative_config=spec)
    runner = probe.engine.core.runner
    assert len(runner.cache_layers()) == 4                                # 3 target layers + 1 draft layer
    got, llm = _tokens(target, spec, kv_cache_memory_bytes=10 * 4 * runner.kv_bytes_per_token())
    assert got == plain
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.spec_decode.num_draft_tokens > 0


def test_a_draft_as_deep_as_the_target_is_always_accepted(tiny_model_factory, tmp_path):
    """A draft model with the target's own weights drafts the target's greedy tokens: every draft is
    accepted, which checks that drafts go to the right positions."""
    target = tiny_model_factory("llama")
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": target, "adaptive": False}
    plain, _ = _tokens(target)
    got, llm = _tokens(target, spec)
    assert got == plain
    s = llm.engine.stats().spec_decode
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens


def test_bad_draft_configs_are_clear_errors(tiny_model_factory):
    model = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=r"draft_num_layers must be in \[1, 2\), got 2"):
        LLM(model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 2})
    other = tiny_model_factory("llama", vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the target 49152"):
        LLM(model, kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": other})
    short = tiny_model_factory("llama", max_position_embeddings=20)          # the target has 512
    with pytest.raises(ValueError, match="has 20 positions .* fewer than max_model_len 512: pass max_model_len <= 20"):
        LLM(model, kv_cache_memory_bytes=1 << 22,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": short})
    llm = LLM(model, kv_cache_memory_bytes=1 << 22, max_model_len=20, block_size=4,
              speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": short})
    out = llm.generate([[5, 6, 7, 8] * 4], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert (out.outputs[0].finish_reason, len(out.outputs[0].token_ids)) == ("length", 4)   # to the end, no error


def test_rows_held_when_a_request_finishes_reach_the_blocks_a_prefix_hit_reuses(tiny_model_factory, monkeypatch):
    """A draft model with the target's weights drafts exactly the target's tokens where its cache is
    complete. A request that drafts nothing (k = 0) finishes with its rows held; the same sequence submitted
    again hits its blocks in the prefix cache, and every draft is accepted: the held rows reached the draft
    model's cache before the blocks were reused."""
    target = tiny_model_factory("llama")
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": target, "adaptive": True}
    llm = LLM(target, block_size=4, kv_cache_memory_bytes=1 << 22, speculative_config=spec,
              enable_prefix_caching=True)
    k = [0]
    monkeypatch.setattr(llm.engine.core.draft_length, "choose", lambda model, positions: k[0])
    first = llm.generate([PROMPTS[1]], GREEDY)[0]
    k[0] = 3
    before = llm.engine.stats()
    llm.generate([PROMPTS[1] + first.outputs[0].token_ids], GREEDY)
    after = llm.engine.stats()
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == 24       # 6 blocks of 4
    drafted = after.spec_decode.num_draft_tokens - before.spec_decode.num_draft_tokens
    accepted = after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens
    assert drafted > 0 and accepted == drafted
