"""A sliding window without sinks (Mistral, Mixtral, Qwen2, Qwen3-MoE: forward_with_sinks with sinks None):
layers/attention/sinks.py's torch path against a naive masked softmax (a query at p reads p - window + 1 .. p),
the CPU backend's native kernels and the Triton kernels (under Triton's interpreter without a GPU) against
the torch path, and the engine on the Triton backend against the reference backend."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: kernels run on the CPU

from tokenmill.layers.attention import get_backend
from tokenmill.layers.attention.sinks import sink_attention
from test_attention import decode_step, needs_native_prefill, prefill_step  # tests/layers, on sys.path

WINDOWS = [None, 1, 5, 40]


def _naive(q, k_cache, v_cache, meta, scale, window):
    """Per request, per query row: softmax over its window's keys only; q [T, H, D] -> [T, H * D]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[0]
    for s in meta.seqs:
        keys = k_cache[:, s.context_slots].repeat_interleave(group, dim=0)          # [H, L, D]
        values = v_cache[:, s.context_slots].repeat_interleave(group, dim=0)
        for j in range(s.query_len):
            p = s.context_len - s.query_len + j
            lo = 0 if window is None else max(0, p - window + 1)
            scores = torch.einsum("hd,hld->hl", q[s.query_start + j].double(), keys[:, lo:p + 1].double()) * scale
            out[s.query_start + j] = torch.einsum("hl,hld->hd", scores.softmax(-1), values[:, lo:p + 1].double())
    return out.reshape(q.shape[0], -1)


def _torch_path(q, k, v, kc, vc, meta, scale, window):
    kc, vc = kc.clone(), vc.clone()
    get_backend("reference").store(k, v, kc, vc, meta.slot_mapping)
    return sink_attention(q, kc, vc, meta, scale, None, window), kc, vc


@pytest.mark.parametrize("window", WINDOWS)
def test_the_torch_path_without_sinks_is_the_windowed_softmax(window):
    q, k, v, kc, vc, meta = prefill_step([(0, 30), (12, 9)], 2, 2, 16, seed=3)
    out, kc, vc = _torch_path(q, k, v, kc, vc, meta, 0.25, window)
    assert (out - _naive(q, kc, vc, meta, 0.25, window)).abs().max() < 1e-5
    if window is None:                                  # no window, no sinks: the plain causal attention
        full = get_backend("reference").forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25)
        assert (out - full).abs().max() < 1e-5


@needs_native_prefill
@pytest.mark.parametrize("window", WINDOWS)
def test_the_cpu_kernels_without_sinks_are_the_torch_path(window):
    for q, k, v, kc, vc, meta in (prefill_step([(0, 70), (33, 20)], 2, 3, 64, seed=1),
                                  decode_step([1, 6, 90], 2, 3, 64, seed=2)):
        native = get_backend("cpu").forward_with_sinks(q, k, v, kc.clone(), vc.clone(), meta, 0.125, None, window)
        ref, _, _ = _torch_path(q, k, v, kc, vc, meta, 0.125, window)
        assert (native - ref).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 5])
def test_the_triton_kernels_without_sinks_are_the_torch_path(window):
    pytest.importorskip("triton")
    from tokenmill.layers.attention.triton_kernels import paged_decode_attention, paged_prefill_attention
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(window)
    block_size, kv_heads, group, head_dim = 8, 2, 2, 64
    context_lens = [3, 19]
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    k_cache = torch.randn(kv_heads, 6 * block_size, head_dim, generator=g)
    v_cache = torch.randn(kv_heads, 6 * block_size, head_dim, generator=g)
    q = torch.randn(2, kv_heads * group, head_dim, generator=g)
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    seqs = [SeqSpan(i, 1, n, tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
            for i, n in enumerate(context_lens)]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), seqs)
    ref = sink_attention(q, k_cache, v_cache, meta, 0.125, None, window).view(q.shape)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    dev = lambda t: t.to(device)  # noqa: E731
    out = paged_decode_attention(dev(q), dev(k_cache), dev(v_cache), dev(tables), lens, block_size, 0.125,
                                 sinks=None, window=window)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    starts, ones = torch.tensor([0, 1], dtype=torch.int32, device=device), torch.ones(2, dtype=torch.int32, device=device)
    out = paged_prefill_attention(dev(q), dev(k_cache), dev(v_cache), dev(tables), starts, ones, lens, block_size,
                                  0.125, 1, sinks=None, window=window)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
