"""FP8 (E4M3) KV cache, kv_cache_dtype="fp8" (K/V per kv head, and MLA's latent cache): a quarter of fp32's
bytes, counted as such; the native decode and prefill
kernels equal the torch path and the native cache write is bitwise torch's quantizer; the engine's logits stay within a stated bound of the fp32 cache's (greedy
tokens equal up to near-ties); checkpoint scales are used; bad settings are refused by name."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention.base import AttentionMetadata, SeqSpan
from tokenmill.layers.attention.cpu import CPUAttention
from tokenmill.layers.attention.fp8_kv import FP8_MAX, KVScales, dequantize, quantize, write_fp8_cache

from models.test_parity import capture_logits, prompts

# |logit(fp8 KV) - logit(fp32 KV)| on the tiny random models (logits of magnitude ~5): 3 mantissa bits per
# cached value, partly averaging out over the context. Measured 0.16 (cpu) and 0.18 (reference) here.
LOGIT_BOUND = 0.3


def test_round_trip_error_and_saturation():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 16) * torch.tensor([0.01, 1.0, 30.0]).view(1, 3, 1)   # heads of very different size
    scales = KVScales(3)
    scales.calibrate(x, x)
    assert torch.allclose(scales.k, x.abs().amax(dim=(0, 2)) * 4 / FP8_MAX)
    back = dequantize(quantize(x, scales.k).transpose(0, 1), scales.k).transpose(0, 1)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scales.k.view(1, 3, 1) * 2 ** -9).all()
    big = quantize(x * 100, scales.k).float()                                       # far past the headroom
    assert torch.isfinite(big).all() and big.abs().max() == FP8_MAX
    scales.calibrate(x * 7, x * 7)                                                  # fixed once set
    assert torch.allclose(scales.k, x.abs().amax(dim=(0, 2)) * 4 / FP8_MAX)


def _cache(kv_heads=2, slots=64, dim=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(slots, kv_heads, dim, generator=g), torch.randn(slots, kv_heads, dim, generator=g) * 3
    k_cache = torch.zeros(kv_heads, slots, dim, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    scales = KVScales(kv_heads)
    write_fp8_cache(k, v, k_cache, v_cache, torch.arange(slots), scales)
    return k_cache, v_cache, scales


def _native_backend() -> CPUAttention:
    backend = CPUAttention()
    if backend.native is None:
        pytest.skip("no native build here")
    return backend


# head dims 64 / 128: the vectorized kernel shared with the float32 cache (batch 1: context cut into chunks
# across threads); 32: the portable one. Groups of 1 to 4 query heads per kv head (passes of up to 3).
@pytest.mark.parametrize("head_dim,group,lens", [(64, 3, [64, 9, 1, 33]), (128, 2, [64, 9, 1, 33]),
                                                 (64, 4, [57]), (128, 1, [2]), (32, 3, [64, 9, 1, 33])])
def test_native_fp8_decode_equals_torch_path(head_dim, group, lens):
    backend = _native_backend()
    k_cache, v_cache, scales = _cache(dim=head_dim)
    lens = torch.tensor(lens)
    slots = torch.stack([torch.randperm(64)[:64] for _ in lens])
    mask = torch.where(torch.arange(64).unsqueeze(0) < lens.unsqueeze(1), 0.0, float("-inf")).unsqueeze(1)
    rows = torch.arange(len(lens))
    meta = AttentionMetadata(rows, [], decode_rows=rows, decode_slots=slots, decode_mask=mask, decode_lens=lens)
    q = torch.randn(len(lens), 2 * group, head_dim)
    native = backend._decode_any(q, k_cache, v_cache, meta, head_dim ** -0.5, scales)
    torch_path = CPUAttention._decode(q, k_cache, v_cache, meta, head_dim ** -0.5, scales)
    assert (native - torch_path).abs().max().item() < 1e-5


def _every_rounding_case() -> torch.Tensor:
    """Every finite E4M3 value, every midpoint between neighbours (ties: to even), values past +-448 and
    below the smallest subnormal, signed zeros."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()
    midpoints = (values[1:] + values[:-1]) / 2
    return torch.cat([values, midpoints, torch.tensor([0.0, -0.0, 1e-30, -2.0 ** -12, 449.0, 500.0, -1e9, 3e38])])


@pytest.mark.parametrize("head_dim", [64, 24])                 # 24: 16 lanes and a tail of 8
def test_native_fp8_write_is_bitwise_the_torch_quantizer(head_dim):
    backend = _native_backend()
    g = torch.Generator().manual_seed(3)
    kv_heads, tokens, num_slots = 2, 60, 100
    cases = _every_rounding_case()
    for given_scales in (True, False):
        # k, v as the model makes them: kv heads' slices of one wider row (strided)
        qkv = torch.randn(tokens, kv_heads, 3 * head_dim, generator=g) \
            * 10.0 ** torch.randint(-4, 3, (tokens, 1, 1), generator=g)
        k, v = qkv[..., :head_dim], qkv[..., head_dim:2 * head_dim]
        if given_scales:                                          # key scale 1: the cases sit on the codes' grid
            filled = k.reshape(-1).clone()
            filled[:cases.numel()] = cases
            k.copy_(filled.view_as(k))
        slots = torch.randperm(num_slots, generator=g)[:tokens]
        torch_caches = [torch.zeros(kv_heads, num_slots, head_dim, dtype=torch.float8_e4m3fn) for _ in range(2)]
        native_caches = [torch.zeros_like(c) for c in torch_caches]
        scales = KVScales(kv_heads)
        if given_scales:
            scales.set(torch.ones(1), torch.tensor([0.37]))
        write_fp8_cache(k, v, *torch_caches, slots, scales)              # calibrates when not given
        backend._store(k, v, *native_caches, slots, scales)
        for ours, reference in zip(native_caches, torch_caches):
            assert torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))


def test_native_fp8_write_refuses_bad_arguments():
    backend = _native_backend()
    k = torch.randn(4, 2, 64)
    cache = torch.zeros(2, 8, 64, dtype=torch.float8_e4m3fn)
    ones = torch.ones(2)
    write = backend.native.write_kv_cache_fp8
    with pytest.raises(RuntimeError, match="slot out of range"):
        write(k, k, cache, cache, torch.tensor([0, 1, 2, 8]), ones, ones)
    with pytest.raises(RuntimeError, match="float32 \\[T, KV, D\\]"):
        write(k.double(), k, cache, cache, torch.arange(4), ones, ones)
    with pytest.raises(RuntimeError, match="one-byte \\[KV, S, D\\]"):
        write(k, k, cache.float(), cache, torch.arange(4), ones, ones)
    with pytest.raises(RuntimeError, match="scales must be float32 \\[KV\\]"):
        write(k, k, cache, cache, torch.arange(4), torch.ones(3), ones)
    with pytest.raises(RuntimeError, match="as many slots"):
        write(k, k, cache, torch.zeros(2, 9, 64, dtype=torch.float8_e4m3fn), torch.arange(4), ones, ones)


@pytest.mark.parametrize("chunks", [[(0, 40)], [(0, 33), (64, 31), (5, 97)]])
@pytest.mark.parametrize("head_dim,kv_heads,group", [(64, 3, 3), (128, 2, 1)])
def test_native_fp8_prefill_reads_the_codes_in_place(chunks, head_dim, kv_heads, group, monkeypatch):
    """csrc/prefill_attention.cpp on an FP8 cache: every key and value a chunk reads (its own new ones too,
    as written) is code x scale; equal to the reference backend over the dequantized cache."""
    from tokenmill.layers.attention import get_backend
    from layers.test_attention import prefill_step
    backend = CPUAttention()
    if backend.native is None or not backend.native.prefill_attention_supports(head_dim):
        pytest.skip("the native prefill kernel needs an AVX-512 build and a compiler")
    q, k, v, kc, vc, meta = prefill_step(chunks, kv_heads, group, head_dim, seed=head_dim + len(chunks))
    scales = KVScales(kv_heads)
    scales.calibrate(k, v)
    k8, v8 = (quantize(c.transpose(0, 1), s).transpose(0, 1).contiguous() for c, s in ((kc, scales.k), (vc, scales.v)))
    as_written = [dequantize(quantize(x, s).transpose(0, 1), s).transpose(0, 1) for x, s in ((k, scales.k), (v, scales.v))]
    scale = head_dim ** -0.5
    ref = get_backend("reference").forward(q, *as_written, dequantize(k8, scales.k), dequantize(v8, scales.v), meta,
                                           scale)
    calls, real = [], backend.native.prefill_attention
    monkeypatch.setattr(backend.native, "prefill_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    out = backend.forward(q, k, v, k8, v8, meta, scale, kv_scales=scales)
    assert len(calls) == 1 and calls[0]["k_scale"] is scales.k
    assert (out - ref).abs().max().item() < 1e-4


def _run(model_dir, kv_cache_dtype, backend="cpu", native=True):
    llm = LLM(model_dir, kv_cache_dtype=kv_cache_dtype, attention_backend=backend, max_num_batched_tokens=13,
              block_size=4, kv_cache_memory_bytes=1 << 22, native_decode_layers=native)
    captured = capture_logits(llm)
    outs = llm.generate(prompts(1, [5, 30, 17, 1]), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return llm, outs, captured


def worst_logit_difference(ref_outs, ref_rows, outs, rows, bound: float) -> float:
    """The largest |logit difference| of two runs' steps, each request up to its first differing token (a
    near-tie of the reference's logits, within 2 x bound, that flipped: later steps see other tokens)."""
    worst = 0.0
    for a, b in zip(ref_outs, outs):
        for j, (x, y) in enumerate(zip(ref_rows[a.request_id], rows[b.request_id])):
            worst = max(worst, (x - y).abs().max().item())
            mine, theirs = b.outputs[0].token_ids[j], a.outputs[0].token_ids[j]
            if mine != theirs:
                assert x[theirs] - x[mine] <= 2 * bound
                break
    return worst


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_fp8_cache_logits_within_bound_of_fp32_cache(tiny_model_dir, backend):
    """Chunked prefill mixed with decodes (budget 13, blocks of 4): prefill chunks read earlier chunks'
    FP8 context, decodes read all of it."""
    _, ref_outs, ref_rows = _run(tiny_model_dir, "auto", backend)
    llm, outs, rows = _run(tiny_model_dir, "fp8", backend)
    worst = worst_logit_difference(ref_outs, ref_rows, outs, rows, LOGIT_BOUND)
    print(f"max |logit difference| fp8 vs fp32 KV: {worst:.3g}")
    assert 0 < worst <= LOGIT_BOUND        # > 0: the cache really is FP8
    cfg = llm.engine.config.model
    assert cfg.kv_bytes_per_token == cfg.num_layers * 2 * cfg.kv_size         # one byte a value
    layer = llm.engine.core.runner.model.attention_layers()[0]
    assert layer.k_cache.dtype == torch.float8_e4m3fn and layer.kv_scales.ready


@pytest.mark.parametrize("dtype,factor", [("fp8", 4), ("bfloat16", 2)])
def test_cache_capacity_grows_as_a_value_shrinks(tiny_model_dir, dtype, factor):
    """FP8: a quarter of float32's bytes a value, four times the blocks in the same memory; bfloat16: half, twice."""
    sizes = {}
    for name in ("auto", dtype):
        llm = LLM(tiny_model_dir, kv_cache_dtype=name, kv_cache_memory_bytes=1 << 22)
        stats = llm.engine.core.stats()
        sizes[name] = (llm.engine.config.cache.num_blocks, stats.kv_bytes_per_token)
    assert sizes[dtype][1] * factor == sizes["auto"][1]
    assert sizes[dtype][0] >= factor * sizes["auto"][0] - 1


def test_checkpoint_scales_are_used(tiny_model_factory, tmp_path):
    import shutil
    from safetensors.torch import load_file, save_file
    src = tiny_model_factory("llama", tie_word_embeddings=False)
    model_dir = str(tmp_path / "scaled")
    shutil.copytree(src, model_dir)
    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    state["model.layers.0.self_attn.v_scale"] = torch.tensor(0.03)
    save_file(state, path, metadata={"format": "pt"})
    llm = LLM(model_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 22)
    layers = llm.engine.core.runner.model.attention_layers()
    assert layers[0].kv_scales.ready and torch.allclose(layers[0].kv_scales.k, torch.tensor(0.02))
    assert torch.allclose(layers[0].kv_scales.v, torch.tensor(0.03))
    assert not layers[1].kv_scales.ready                                          # calibrated when first used
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert layers[1].kv_scales.ready
    LLM(model_dir, kv_cache_memory_bytes=1 << 22)                                 # float cache: scales unused


def test_bad_kv_cache_dtype_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int3'"):
        LLM(tiny_model_dir, kv_cache_dtype="int3")


def test_mla_latent_cache_in_fp8_is_a_byte_a_value_and_stays_close(tiny_model_factory):
    """DeepSeek's latent cache: latents and rope keys as E4M3 codes under a scale each per layer; chunked
    prefill reads earlier chunks' FP8 latents, decodes read all of them (the absorbed form). Dense MLPs: with
    the tiny model's experts a 3% change of a hidden state can flip a near-tied routing choice (measured: one
    prompt's logits 77% apart), which says nothing about the cache."""
    model_dir = tiny_model_factory("deepseek_v3", first_k_dense_replace=3)
    _, ref_outs, ref_rows = _run(model_dir, "auto")
    llm, outs, rows = _run(model_dir, "fp8")
    worst = max((x - y).abs().max().item() for a, b in zip(ref_outs, outs)
                for x, y in zip(ref_rows[a.request_id][:1], rows[b.request_id][:1]))     # first tokens: same context
    print(f"max |first-token logit difference| fp8 vs fp32 latent cache: {worst:.3g}")
    assert 0 < worst <= LOGIT_BOUND
    cfg = llm.engine.config.model
    assert cfg.kv_bytes_per_token == cfg.num_layers * cfg.mla.latent_dim              # one byte a value
    layer = llm.engine.core.runner.model.attention_layers()[0]
    assert layer.latent_cache.dtype == torch.float8_e4m3fn and layer.kv_scales.ready
    assert float(layer.kv_scales.k) != float(layer.kv_scales.v)                        # latent and rope key apart
    stats = LLM(model_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=1 << 22).engine.core.stats()
    assert stats.kv_bytes_per_token * 4 == LLM(model_dir, kv_cache_memory_bytes=1 << 22).engine.core.stats().kv_bytes_per_token
