"""Logits parity with transformers on tiny random models: prefill and every decode step through the
paged cache, with chunked prefill and prefix-cache hits, for every supported architecture variant."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams

TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied-llama3-rope": ("llama", dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "mistral": ("mistral", dict(tie_word_embeddings=False, sliding_window=None)),
    # sliding windows shorter than the prompts, through chunked prefill and decodes: every layer (Mistral),
    # the layers from max_window_layers on (Qwen2); head dim 64: the CPU's native windowed kernels
    "mistral-window": ("mistral", dict(tie_word_embeddings=False, sliding_window=4)),
    "mistral-window-native-attention": ("mistral", dict(tie_word_embeddings=False, sliding_window=5, head_dim=64)),
    "qwen2-window": ("qwen2", dict(tie_word_embeddings=False, use_sliding_window=True, sliding_window=4,
                                   max_window_layers=1)),
    # hidden_act other than SiLU (the per-op path: the native decoder layers compute SwiGLU only)
    "llama-gelu": ("llama", dict(hidden_act="gelu")),
    "llama-gelu-tanh": ("llama", dict(hidden_act="gelu_pytorch_tanh")),
    # attention_bias (q/k/v and o) and mlp_bias (gate/up and down), native decoder layers included
    "llama-biases": ("llama", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
}


def capture_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Record, per request id, the logits row the sampler saw at every sampling step."""
    runner = llm.engine.core.runner
    captured: dict[str, list[torch.Tensor]] = {}
    order: list[str] = []
    sampler, execute = runner.sampler, runner.execute

    def sample(logits, metas):
        for rid, row in zip(order, logits):
            captured.setdefault(rid, []).append(row.clone())
        return sampler(logits, metas)

    def run(sched_out):
        order[:] = [sr.request_id for sr in sched_out.scheduled if sr.sample]
        return execute(sched_out)

    runner.sampler, runner.execute = sample, run
    runner.greedy_head = None   # every step through the sampler, so every logits row is seen
    return captured


def hf_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def check_request(model_dir, out, rows) -> float:
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    ref = hf_logits(model_dir, prompt + gen)
    assert len(rows) == len(gen)
    worst = 0.0
    for j, row in enumerate(rows):
        worst = max(worst, (row - ref[len(prompt) - 1 + j]).abs().max().item())
        assert int(row.argmax()) == gen[j]
    assert worst <= TOL, f"max abs logits difference {worst:.2e} > {TOL}"
    return worst


def prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tiny_model_factory, variant, backend):
    arch, overrides = VARIANTS[variant]
    model_dir = tiny_model_factory(arch, **overrides)
    # a small token budget forces chunked prefill mixed with decodes of other requests
    llm = LLM(model_dir, attention_backend=backend, max_num_batched_tokens=13, block_size=4,
              kv_cache_memory_bytes=1 << 22)
    captured = capture_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(prompts(1, [5, 30, 17, 1]), params)
    for out in outs:
        check_request(model_dir, out, captured[out.request_id])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("arch,overrides", [("llama", dict(tie_word_embeddings=True)),
                                            ("mistral", dict(tie_word_embeddings=False, sliding_window=4))])
def test_prefix_cache_hits_keep_logits_exact(tiny_model_factory, backend, arch, overrides):
    """A hit's blocks hold every position's keys and values (a windowed layer's too: it attends to the last
    `window` of them), so the rest of the prompt and the decodes see what a fresh prefill gives."""
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(model_dir, attention_backend=backend, block_size=4, kv_cache_memory_bytes=1 << 22)
    captured = capture_logits(llm)
    shared = prompts(2, [21])[0]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    first = llm.generate([shared + [7, 8, 9]], params)[0]
    second = llm.generate([shared + [10, 11], shared], params)
    assert first.num_cached_tokens == 0
    assert second[0].num_cached_tokens == 20   # 5 full blocks of the shared 21 tokens
    assert second[1].num_cached_tokens == 20   # all 21 cached, but the last token is recomputed for logits
    for out in [first, *second]:
        check_request(model_dir, out, captured[out.request_id])
