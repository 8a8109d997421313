"""Decode steps of a few rows run one native call per decoder layer (csrc/decode_layer.cpp): the same
kernels as the per-op path, so the same tokens and (to float rounding) the same log-probabilities."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="needs the native kernels (a compiler)")

PROMPTS = [[11, 220, 4890, 17, 9, 300, 5], [7, 8, 9], [1000, 2000, 3000, 4000, 5000]]


def run(model_dir: str, mode: str | None, native: bool, prompts):
    llm = LLM(model_dir, quantization=mode, native_decode_layers=native, enable_prefix_caching=False,
              kv_cache_memory_bytes=1 << 22, block_size=4)
    model = llm.engine.core.runner.model.model
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    expect_native = native and mode != "w8a8"
    assert (model.native_steps == 7) if expect_native else (model.native_steps == 0)   # 8 tokens: 7 decodes
    bound = model.native_layers is not None
    return bound, [(o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("mode", [None, "int8", "int4"])
@pytest.mark.parametrize("arch,overrides", [("llama", dict(tie_word_embeddings=True)),
                                            ("qwen2", dict(tie_word_embeddings=False))])   # qkv bias
@pytest.mark.parametrize("batch", [1, 3])
def test_native_layers_match_the_per_op_path(tiny_model_factory, mode, arch, overrides, batch):
    model_dir = tiny_model_factory(arch, **overrides)
    prompts = PROMPTS[:batch]
    bound, native = run(model_dir, mode, True, prompts)
    unbound, per_op = run(model_dir, mode, False, prompts)
    assert bound and not unbound
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(native, per_op):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


def test_w8a8_keeps_the_per_op_path(tiny_model_factory):
    bound, _ = run(tiny_model_factory("llama"), "w8a8", True, PROMPTS[:1])
    assert not bound
