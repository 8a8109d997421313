"""bfloat16 KV cache, kv_cache_dtype="bfloat16": two bytes a value (half of float32's), counted as such. Each key
and value is rounded to nearest even as written (the native write bitwise torch's .to(torch.bfloat16)) and read
back exactly as float32, so the native decode and prefill kernels on a bfloat16 cache equal the same kernels on
that cache widened to float32; the engine's logits stay within a stated bound of the float32 cache's, in the
native decode program and the per-op path alike; bad settings are refused by name."""
from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.layers.attention import get_backend
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.cpu import CPUAttention
from tokenmill.quant import tile_kernels

from layers.test_fp8_kv import _run, worst_logit_difference
from models.test_parity import prompts

# |logit(bfloat16 KV) - logit(float32 KV)| on the tiny random models (logits of magnitude ~5): 8 significant bits
# per cached value (relative rounding error <= 2^-9). Measured 0.011-0.012 here; FP8's bound is 0.3.
LOGIT_BOUND = 0.03


def _native_backend() -> CPUAttention:
    backend = CPUAttention()
    if backend.native is None:
        pytest.skip("no native build here")
    return backend


def _bf16_cache(kv_heads=2, slots=64, dim=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(kv_heads, slots, dim, generator=g).to(torch.bfloat16),
            (torch.randn(kv_heads, slots, dim, generator=g) * 3).to(torch.bfloat16))


@pytest.mark.parametrize("head_dim", [64, 24])                 # 24: no vector path, the element loop alone
def test_native_write_rounds_as_torch_does(head_dim):
    """k, v strided slices of one wider row (as the model makes them); ties, the largest finite values (round to
    inf), subnormals and NaN (stays NaN) among them."""
    backend = _native_backend()
    g = torch.Generator().manual_seed(5)
    kv_heads, tokens, num_slots = 2, 40, 90
    qkv = torch.randn(tokens, kv_heads, 3 * head_dim, generator=g) \
        * 10.0 ** torch.randint(-30, 30, (tokens, 1, 1), generator=g)
    k, v = qkv[..., :head_dim], qkv[..., head_dim:2 * head_dim]
    cases = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4e38, -3.3895e38, 1e-40, -0.0,
                          float("inf"), float("nan")])
    k[0, 0, :cases.numel()] = cases
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    ours = [torch.zeros(kv_heads, num_slots, head_dim, dtype=torch.bfloat16) for _ in range(2)]
    reference = [torch.zeros_like(c) for c in ours]
    backend._store(k, v, *ours, slots, None)
    CPUAttention.write_cache(k, v, *reference, slots)
    for a, b in zip(ours, reference):
        nan = a.isnan()
        assert torch.equal(nan, b.isnan()) and nan.sum() == (1 if a is ours[0] else 0)
        assert torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])
    assert ours[0][0, slots[0], 0].item() == 1.0 and ours[0][0, slots[0], 1].item() == 1 + 2 ** -6  # ties to even
    assert ours[0][0, slots[0], 3].item() == float("inf")


def test_native_write_refuses_mixed_or_other_dtypes():
    backend = _native_backend()
    k = torch.randn(4, 2, 64)
    bf16 = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 caches of one dtype"):
        backend.native.write_kv_cache(k, k, bf16, bf16.float(), torch.arange(4))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 caches of one dtype"):
        backend.native.write_kv_cache(k, k, bf16.half(), bf16.half(), torch.arange(4))
    with pytest.raises(RuntimeError, match="slot out of range"):
        backend.native.write_kv_cache(k, k, bf16, bf16, torch.tensor([0, 1, 2, 8]))
    with pytest.raises(RuntimeError, match="float32 or bfloat16 caches of one dtype"):
        backend.native.paged_decode_attention(torch.randn(1, 2, 64), bf16, bf16.float(),
                                              torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                                              0.125)


# head dims 64 / 128: the vectorized kernel (batch 1: context cut into chunks across threads); 32: the portable
# one. Groups of 1 to 4 query heads per kv head; with and without gpt-oss's sinks and a sliding window.
@pytest.mark.parametrize("head_dim,group,lens", [(64, 3, [64, 9, 1, 33]), (128, 2, [64, 9, 1, 33]),
                                                 (64, 4, [57]), (32, 3, [64, 9, 1, 33])])
@pytest.mark.parametrize("sinks_and_window", [False, True])
def test_native_decode_reads_the_bf16_cache_exactly(head_dim, group, lens, sinks_and_window):
    backend = _native_backend()
    k_cache, v_cache = _bf16_cache(dim=head_dim)
    lens = torch.tensor(lens)
    slots = torch.stack([torch.randperm(64) for _ in lens])
    q = torch.randn(len(lens), 2 * group, head_dim)
    extra = dict(sinks=torch.randn(2 * group), window=20) if sinks_and_window else {}
    decode = backend.native.paged_decode_attention
    ours = decode(q, k_cache, v_cache, slots, lens, head_dim ** -0.5, **extra)
    widened = decode(q, k_cache.float(), v_cache.float(), slots, lens, head_dim ** -0.5, **extra)
    if head_dim in (64, 128):                                  # one kernel, the same float32 arithmetic
        assert torch.equal(ours, widened)
    else:                                                      # the portable loop: vectorized apart by the compiler
        assert (ours - widened).abs().max().item() < 1e-5
    if not sinks_and_window:                                   # and the torch fallback on the bf16 cache
        mask = torch.where(torch.arange(64).unsqueeze(0) < lens.unsqueeze(1), 0.0, float("-inf")).unsqueeze(1)
        rows = torch.arange(len(lens))
        meta = AttentionMetadata(rows, [], decode_rows=rows, decode_slots=slots, decode_mask=mask, decode_lens=lens)
        torch_path = CPUAttention._decode(q, k_cache, v_cache, meta, head_dim ** -0.5)
        assert (ours - torch_path).abs().max().item() < 1e-5


@pytest.mark.parametrize("chunks", [[(0, 40)], [(0, 33), (64, 31), (5, 97)]])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 3, 3), (128, 2, 1)])
def test_native_prefill_reads_the_bf16_cache_in_place(chunks, head_dim, kv_heads, group, monkeypatch):
    """csrc/prefill_attention.cpp on a bfloat16 cache: every key and value a chunk reads (its own new ones too,
    as written, rounded) widened exactly; equal to the reference backend over the widened cache."""
    from layers.test_attention import prefill_step
    backend = CPUAttention()
    if backend.native is None or not backend.native.prefill_attention_supports(head_dim):
        pytest.skip("the native prefill kernel needs an AVX-512 build and a compiler")
    q, k, v, kc, vc, meta = prefill_step(chunks, kv_heads, group, head_dim, seed=head_dim + len(chunks))
    k16, v16 = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    scale = head_dim ** -0.5
    as_written = [x.to(torch.bfloat16).float() for x in (k, v)]
    ref = get_backend("reference").forward(q, *as_written, k16.float(), v16.float(), meta, scale)
    calls, real = [], backend.native.prefill_attention
    monkeypatch.setattr(backend.native, "prefill_attention", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    out = backend.forward(q, k, v, k16, v16, meta, scale)
    assert len(calls) == 1 and calls[0][1].dtype == torch.bfloat16
    assert (out - ref).abs().max().item() < 1e-4
    torch_path = CPUAttention()                                # the torch fallback on the same cache
    torch_path.native = None
    k16b, v16b = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
    fallback = torch_path.forward(q, k, v, k16b, v16b, meta, scale)
    assert torch.equal(k16b.view(torch.int16), k16.view(torch.int16))      # the same rounding as written natively
    assert (fallback - ref).abs().max().item() < 2e-2                      # a chunk at 0 reads its unrounded keys


@pytest.mark.parametrize("backend,native", [("cpu", True), ("cpu", False), ("reference", False)])
def test_bf16_cache_logits_within_bound_of_fp32_cache(tiny_model_dir, backend, native):
    """Chunked prefill mixed with decodes (budget 13, blocks of 4): prefill chunks read earlier chunks'
    bfloat16 context, decodes read all of it; in the native decode program (bound to the bfloat16 cache) and
    the per-op kernels."""
    _, ref_outs, ref_rows = _run(tiny_model_dir, "auto", backend, native)
    llm, outs, rows = _run(tiny_model_dir, "bfloat16", backend, native)
    worst = worst_logit_difference(ref_outs, ref_rows, outs, rows, LOGIT_BOUND)
    print(f"max |logit difference| bf16 vs fp32 KV: {worst:.3g}")
    assert 0 < worst <= LOGIT_BOUND        # > 0: the cache really is bfloat16
    runner = llm.engine.core.runner
    cfg = llm.engine.config.model
    assert cfg.kv_bytes_per_token == cfg.num_layers * 2 * cfg.kv_size * 2             # two bytes a value
    layer = runner.model.attention_layers()[0]
    assert layer.k_cache.dtype == torch.bfloat16 and getattr(layer, "kv_scales", None) is None
    program = runner.fused_decode
    if backend == "cpu" and native and tile_kernels.kernels() is not None:
        assert program is not None and program.steps > 0
    elif not native:
        assert program is None


def test_bf16_cache_in_the_native_program_matches_its_per_op_path(tiny_model_factory):
    """Both write the same rounded values and read them back exactly: tokens equal, logprobs within 1e-4."""
    model_dir = tiny_model_factory("qwen2", tie_word_embeddings=False)
    results = []
    for native in (True, False):
        llm = LLM(model_dir, kv_cache_dtype="bfloat16", native_decode_layers=native, enable_prefix_caching=False,
                  kv_cache_memory_bytes=1 << 23, block_size=4)
        if native and llm.engine.core.runner.fused_decode is None:
            pytest.skip("no native decode program here")
        outs = llm.generate(prompts(3, [7, 3, 11]), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                   logprobs=0))
        results.append([(o.outputs[0].token_ids, [lp.sampled.logprob for lp in o.outputs[0].logprobs]) for o in outs])
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(*results):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-4


def test_mla_latent_cache_in_bf16_stays_close(tiny_model_factory):
    """DeepSeek's latent cache in bfloat16 under float32 compute: latents widened as read (dense MLPs, as the
    FP8 test explains)."""
    model_dir = tiny_model_factory("deepseek_v3", first_k_dense_replace=3)
    _, ref_outs, ref_rows = _run(model_dir, "auto")
    llm, outs, rows = _run(model_dir, "bfloat16")
    worst = max((x - y).abs().max().item() for a, b in zip(ref_outs, outs)
                for x, y in zip(ref_rows[a.request_id][:1], rows[b.request_id][:1]))     # first tokens: same context
    assert 0 < worst <= LOGIT_BOUND
    layer = llm.engine.core.runner.model.attention_layers()[0]
    assert layer.latent_cache.dtype == torch.bfloat16


def test_the_option_is_named_as_vllm_names_it():
    from tokenmill.config import KV_CACHE_DTYPES, kv_cache_torch_dtype
    assert kv_cache_torch_dtype("bfloat16") == torch.bfloat16 and "bfloat16" in KV_CACHE_DTYPES
    with pytest.raises(ValueError, match="'bfloat16': two bytes a value"):
        kv_cache_torch_dtype("bf16")
    import argparse
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
