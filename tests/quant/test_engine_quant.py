"""End to end: LLM(quantization=...) on tiny random models (tied and untied heads, Qwen2 biases)."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import AttentionMetadata, SeqSpan

# relative error of the logits of a 24-token prompt vs float32 on these random models; measured about
# int8 0.02, int4 0.21 (random Gaussian weights lose more to 4 bits than trained ones), w8a8 0.026
BOUNDS = {"int8": 0.04, "int4": 0.3, "w8a8": 0.04}
VARIANTS = {"llama-tied": ("llama", dict(tie_word_embeddings=True)),
            "llama-untied": ("llama", dict(tie_word_embeddings=False)),
            "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False))}


@torch.inference_mode()
def prompt_logits(llm: LLM, ids: list[int], last_only: bool = False) -> torch.Tensor:
    """[T, vocab] logits of one prefill through the engine's model (prefix caching is off); last_only:
    [1, vocab] for the last position, the head run on one row as the engine runs it (quantized heads take
    the tile kernel, whose int8 activations per 32 round differently from the exact float path)."""
    model, n = llm.engine.core.runner.model, len(ids)
    slots = torch.arange(n)
    hidden = model(torch.tensor(ids), torch.arange(n), AttentionMetadata(slots, [SeqSpan(0, n, n, slots)]))
    return model.compute_logits(hidden[-1:] if last_only else hidden)


def make(model_dir: str, mode: str | None) -> LLM:
    return LLM(model_dir, quantization=mode, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22,
               block_size=4)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", sorted(BOUNDS))
def test_quantized_engine_generates_close_to_float32(tiny_model_factory, variant, mode):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(arch, **overrides)
    ids = torch.randint(100, 40000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = prompt_logits(make(model_dir, None), ids)
    llm = make(model_dir, mode)
    logits = prompt_logits(llm, ids)
    err = ((logits - ref).norm() / ref.norm()).item()
    assert err < BOUNDS[mode]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([ids, ids[:5]], params)             # decode (1 row) and prefill paths together
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert outs[0].outputs[0].token_ids[0] == int(prompt_logits(llm, ids, last_only=True)[0].argmax())


def test_unknown_quantization_fails_before_loading(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown quantization 'int3' on cpu; supported there: fp8, int4, int8, mxfp4, "
                                         "nvfp4, w8a8"):
        LLM(tiny_model_dir, quantization="int3")
