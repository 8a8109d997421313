"""The CUDA path end to end (marked `gpu`: skipped where torch sees no GPU): logits and greedy tokens
against transformers on the same weights (float32 for exactness, bfloat16 within its rounding), CUDA
graphs on vs off, preemption and prefix caching on the device, and the weight-only methods."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_parity import VARIANTS, capture_logits, prompts
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _hf_logits(model_dir: str, token_ids: list[int], dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids], device="cuda")).logits[0].float().cpu()


def _gpu_llm(model_dir, **kw):
    return LLM(model_dir, device="cuda", block_size=16, max_model_len=256, **kw)


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "llama-untied-llama3-rope", "qwen2-bias"])
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 0.25)])
def test_logits_match_transformers_on_the_gpu(tiny_model_factory, variant, dtype, tol):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(arch, **overrides)
    llm = _gpu_llm(model_dir, dtype=dtype, max_num_batched_tokens=13, enforce_eager=True)
    captured = capture_logits(llm)
    outs = llm.generate(prompts(1, [5, 30, 17, 1]), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for out in outs:
        prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
        ref = _hf_logits(model_dir, prompt + gen, getattr(torch, dtype))
        rows = captured[out.request_id]
        worst = max((row.float().cpu() - ref[len(prompt) - 1 + j]).abs().max().item() for j, row in enumerate(rows))
        assert worst <= tol, f"{dtype}: max abs logits difference {worst:.3g} > {tol}"
        if dtype == "float32":                     # bfloat16 ties may break either way
            assert [int(r.argmax()) for r in rows] == gen


def test_cuda_graphs_give_the_eager_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    batch = prompts(3, [3, 9, 17, 33, 5, 2, 40, 11, 7, 21])        # 10 decodes: bucket 16, 6 padded rows
    eager = [o.outputs[0].token_ids for o in _gpu_llm(model_dir, enforce_eager=True).generate(batch, GREEDY)]
    llm = _gpu_llm(model_dir)
    graphs = llm.engine.core.runner.fused_decode
    assert graphs is not None and graphs.buckets[:4] == [1, 2, 4, 8]
    replayed = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert graphs.replays > 0 and replayed == eager
    single = llm.generate(batch[:1], GREEDY)[0].outputs[0].token_ids  # bucket 1, then alone
    assert single == eager[0]


def test_preemption_on_the_gpu_keeps_tokens(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    batch = prompts(4, [30, 28, 31, 29])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in _gpu_llm(model_dir).generate(batch, params)]
    kv_per_token = 2 * 2 * 2 * 16 * 4                              # layers x K,V x kv heads x head dim x fp32
    tight = _gpu_llm(model_dir, dtype="float32", kv_cache_memory_bytes=kv_per_token * 16 * 9)   # 9 blocks
    tight_roomy = [o.outputs[0].token_ids for o in _gpu_llm(model_dir, dtype="float32").generate(batch, params)]
    squeezed = [o.outputs[0].token_ids for o in tight.generate(batch, params)]
    assert tight.engine.core.scheduler.num_preemptions_total > 0
    assert squeezed == tight_roomy and len(roomy) == 4


def test_prefix_caching_on_the_gpu(tiny_model_factory):
    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    llm = _gpu_llm(model_dir, dtype="float32")
    shared = prompts(2, [40])[0]
    first = llm.generate([shared + [7, 8]], GREEDY)[0]
    second = llm.generate([shared + [7, 8]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8", "nvfp4", "mxfp4"])
def test_weight_only_methods_on_the_gpu(tiny_model_factory, mode):
    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    batch = prompts(5, [12, 30])
    quant = [o.outputs[0].token_ids for o in _gpu_llm(model_dir, dtype="float32", quantization=mode).generate(batch, GREEDY)]
    cpu = [o.outputs[0].token_ids for o in LLM(model_dir, device="cpu", quantization=mode, block_size=16,
                                                 kv_cache_memory_bytes=1 << 22).generate(batch, GREEDY)]
    agree = sum(a == b for x, y in zip(quant, cpu) for a, b in zip(x, y)) / sum(len(x) for x in quant)
    assert agree >= 0.75, f"{mode}: only {agree:.0%} of greedy tokens agree with the CPU's {mode}"
