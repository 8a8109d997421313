"""The model's keep_rows: the last layer skips rows nobody samples (all but the last of a prefill chunk)
after caching their keys and values. The kept rows' hidden states are those of the full pass, and a later
step reading the cache sees the same keys and values."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import AttentionMetadata, SeqSpan


def prefill(model, ids: list[int], keep_rows):
    n, slots = len(ids), torch.arange(len(ids))
    meta = AttentionMetadata(slots, [SeqSpan(0, n, n, slots)])
    return model(torch.tensor(ids), torch.arange(n), meta, keep_rows)


@pytest.mark.parametrize("arch,overrides", [("llama", dict(tie_word_embeddings=True)),
                                            ("qwen2", dict(tie_word_embeddings=False))])
@torch.inference_mode()
def test_kept_rows_equal_the_full_pass_and_the_cache_is_complete(tiny_model_factory, arch, overrides):
    llm = LLM(tiny_model_factory(arch, **overrides), enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22)
    model = llm.engine.core.runner.model
    ids = torch.randint(100, 1000, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    full = prefill(model, ids, None)
    caches = [(layer.k_cache[:, :19].clone(), layer.v_cache[:, :19].clone()) for layer in model.attention_layers()]
    for layer in model.attention_layers():
        layer.k_cache.zero_(), layer.v_cache.zero_()
    keep = torch.tensor([18, 3])
    kept = prefill(model, ids, keep)
    assert kept.shape == (2, full.shape[1])
    torch.testing.assert_close(kept, full[keep], rtol=1e-5, atol=1e-5)
    for layer, (k, v) in zip(model.attention_layers(), caches):      # the last layer's too
        torch.testing.assert_close(layer.k_cache[:, :19], k, rtol=0, atol=0)
        torch.testing.assert_close(layer.v_cache[:, :19], v, rtol=0, atol=0)


def test_chunks_that_sample_nothing_still_fill_the_cache(tiny_model_factory):
    """A prompt longer than the step budget: its first chunks sample no row; tokens match one long step."""
    model_dir = tiny_model_factory("llama")
    ids = torch.randint(100, 1000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for budget in (16, 2048):
        llm = LLM(model_dir, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22,
                  max_num_batched_tokens=budget)
        outs.append(llm.generate([ids], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]
