"""Paged attention backends agree on random mixed batches: the reference, the fast CPU backend with its
native decode kernel, and the same backend's pure-torch decode path (used when no compiler exists)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.layers.attention import get_backend
from tokenmill.platforms import cpu_native, torch_ops
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import build_step_inputs

BLOCK = 4


def random_step(seed: int, kv_heads: int, group: int, head_dim: int = 16):
    """A step with decodes and prefill chunks over shuffled blocks; caches pre-filled with random KV."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    perm = torch.randperm(num_blocks, generator=g).tolist()
    scheduled, used = [], 0
    for i, (start, n) in enumerate([(9, 1), (0, 7), (30, 1), (13, 5), (1, 1), (22, 1)]):
        nb = -(-(start + n) // BLOCK)
        blocks, used = perm[used:used + nb], used + nb
        scheduled.append(ScheduledRequest(str(i), [1] * n, start, blocks, True, SamplingParams(), [], [], []))
    inputs = build_step_inputs(SchedulerOutput(scheduled), BLOCK)
    num_tokens = inputs.input_ids.numel()
    heads = kv_heads * group
    q = torch.randn(num_tokens, heads, head_dim, generator=g)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g)
    k_cache = torch.randn(kv_heads, num_blocks * BLOCK, head_dim, generator=g)
    v_cache = torch.randn(kv_heads, num_blocks * BLOCK, head_dim, generator=g)
    return q, k, v, k_cache, v_cache, inputs.meta


@pytest.mark.parametrize("head_dim", [16, 64, 128])          # 64 and 128 take the vectorized kernel
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3), (1, 4), (3, 3)])
def test_backends_agree(kv_heads, group, head_dim):
    q, k, v, kc, vc, meta = random_step(kv_heads * 10 + group, kv_heads, group, head_dim)
    scale = q.shape[-1] ** -0.5
    ref = get_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    fast = get_backend("cpu")
    assert fast.native is not None, "the native kernel should build on this machine"
    native = fast.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    fast.native = None
    torch_path = fast.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert (native - ref).abs().max() < 1e-5
    assert (torch_path - ref).abs().max() < 1e-5


def decode_step(context_lens: list[int], kv_heads: int, group: int, head_dim: int, seed: int = 0):
    """A decode-only step (one new token per request) over shuffled blocks, caches random."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in context_lens) + 4
    perm = torch.randperm(num_blocks, generator=g).tolist()
    scheduled, used = [], 0
    for i, n in enumerate(context_lens):
        nb = -(-n // BLOCK)
        blocks, used = perm[used:used + nb], used + nb
        scheduled.append(ScheduledRequest(str(i), [1], n - 1, blocks, True, SamplingParams(), [], [], []))
    meta = build_step_inputs(SchedulerOutput(scheduled), BLOCK).meta
    r = len(context_lens)
    shape = (kv_heads, num_blocks * BLOCK, head_dim)
    return (torch.randn(r, kv_heads * group, head_dim, generator=g), torch.randn(r, kv_heads, head_dim, generator=g),
            torch.randn(r, kv_heads, head_dim, generator=g), torch.randn(*shape, generator=g),
            torch.randn(*shape, generator=g), meta)


@pytest.mark.parametrize("context_lens", [[1], [2], [3], [5], [300], [1, 700], [4] * 9])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_decode_splits_short_and_long_contexts_exactly(context_lens, head_dim):
    """Batch 1-2 splits each context into chunks across the threads (some empty when the context is
    shorter than the chunk count) and combines their softmaxes; bigger batches take one chunk each."""
    q, k, v, kc, vc, meta = decode_step(context_lens, 3, 3, head_dim, seed=len(context_lens))
    scale = head_dim ** -0.5
    ref = get_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    fast = get_backend("cpu")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):                                     # chunk count is 2 * threads at small batches
            torch.set_num_threads(n)
            out = fast.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
            assert (out - ref).abs().max() < 1e-5, n
    finally:
        torch.set_num_threads(threads)


def test_native_kernel_is_cached_after_first_build():
    assert cpu_native.load() is cpu_native.load()


def test_native_rotary_and_swiglu_match_torch():
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.platforms.torch_ops import _rotate
    native = cpu_native.load()
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(16, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 9, 63])
    cos, sin = rope.gather(positions)
    qkv = torch.randn(4, 3 * 2 * 16, generator=g)               # q, k, v heads side by side: strided views
    q = qkv[:, :32].view(4, 2, 16)
    want = _rotate(q.clone(), cos.unsqueeze(1), sin.unsqueeze(1))
    native.rotary_inplace(q, cos, sin)
    assert (qkv[:, :32].view(4, 2, 16) - want).abs().max() < 1e-6
    for width in (24, 64, 72):                                   # scalar tail, vector body, both
        x = torch.randn(5, 2 * width, generator=g) * 4
        x[0, :4] = torch.tensor([-120.0, -88.0, 90.0, 120.0])      # exp over/underflow at the extremes
        want = torch.nn.functional.silu(x[:, :width]) * x[:, width:]
        torch.testing.assert_close(native.silu_and_mul(x), want, rtol=1e-6, atol=1e-6)


def test_native_rms_norm_matches_torch_and_updates_the_residual_in_place():
    from tokenmill.layers.norm import RMSNorm
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(96, 1e-5)
    norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    assert norm.kernel is not torch_ops.rms_norm                 # the native kernel
    x, residual = torch.randn(7, 96, generator=g), torch.randn(7, 96, generator=g)
    total = x + residual
    want = torch.nn.functional.rms_norm(total, (96,), norm.weight, 1e-5)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert new_residual is residual and torch.equal(residual, total)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (96,), norm.weight, 1e-5),
                               rtol=1e-6, atol=1e-6)


def prefill_step(chunks: list[tuple[int, int]], kv_heads: int, group: int, head_dim: int, seed: int = 0):
    """A step of prefill chunks (start position, new tokens) plus one decode, over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    chunks = chunks + [(17, 1)]
    num_blocks = sum(-(-(s + n) // BLOCK) for s, n in chunks) + 4
    perm = torch.randperm(num_blocks, generator=g).tolist()
    scheduled, used = [], 0
    for i, (start, n) in enumerate(chunks):
        nb = -(-(start + n) // BLOCK)
        blocks, used = perm[used:used + nb], used + nb
        scheduled.append(ScheduledRequest(str(i), [1] * n, start, blocks, True, SamplingParams(), [], [], []))
    meta = build_step_inputs(SchedulerOutput(scheduled), BLOCK).meta
    t = sum(n for _, n in chunks)
    shape = (kv_heads, num_blocks * BLOCK, head_dim)
    return (torch.randn(t, kv_heads * group, head_dim, generator=g), torch.randn(t, kv_heads, head_dim, generator=g),
            torch.randn(t, kv_heads, head_dim, generator=g), torch.randn(*shape, generator=g),
            torch.randn(*shape, generator=g), meta)


def _native_prefill_built() -> bool:
    native = cpu_native.load()
    return native is not None and native.prefill_attention_supports(64)


needs_native_prefill = pytest.mark.skipif(not _native_prefill_built(),
                                          reason="the native prefill kernel needs an AVX-512 build and a compiler")


@needs_native_prefill
@pytest.mark.parametrize("chunks", [[(0, 2)], [(0, 130)], [(0, 33), (64, 31), (5, 97)], [(200, 70), (0, 128)]])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1), (1, 4)])
def test_native_prefill_kernel_matches_the_reference(chunks, head_dim, kv_heads, group, monkeypatch):
    """csrc/prefill_attention.cpp: prompts starting at 0 and continuation chunks, query blocks of 32 and key
    steps of 32 crossed, grouped-query heads, one call for all of a step's chunks."""
    q, k, v, kc, vc, meta = prefill_step(chunks, kv_heads, group, head_dim, seed=len(chunks) + head_dim)
    scale = head_dim ** -0.5
    ref = get_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    fast = get_backend("cpu")
    assert meta.prefill_spans.tolist() == [[s.query_start, s.query_len, s.context_len] for s in meta.seqs[:-1]]
    calls, real = [], fast.native.prefill_attention
    monkeypatch.setattr(fast.native, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    out = fast.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert calls == [1]
    assert (out - ref).abs().max() < 1e-5


@needs_native_prefill
def test_native_prefill_kernel_rejects_bad_tables():
    native = cpu_native.load()
    q, kc = torch.randn(4, 3, 64), torch.randn(1, 16, 64)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="request 0 has rows 2\\+4"):
        native.prefill_attention(q, kc, kc, torch.tensor([[2, 4, 4]]), torch.zeros(1, 4, dtype=torch.long), 0.1, out)
    with pytest.raises(RuntimeError, match="slot 16 out of range"):
        native.prefill_attention(q, kc, kc, torch.tensor([[0, 4, 4]]), torch.tensor([[0, 1, 2, 16]]), 0.1, out)
    with pytest.raises(RuntimeError, match="D 64 or 128"):
        native.prefill_attention(torch.randn(4, 3, 32), torch.randn(1, 16, 32), torch.randn(1, 16, 32),
                                 torch.tensor([[0, 4, 4]]), torch.zeros(1, 4, dtype=torch.long), 0.1,
                                 torch.empty(4, 3, 32))
