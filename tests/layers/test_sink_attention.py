"""gpt-oss's attention (a sink logit per head, sliding windows) in the native CPU kernels (the CPU backend's
forward_with_sinks: csrc/cpu_kernels.cpp paged_decode_attention, csrc/prefill_attention.cpp
prefill_attention) against the reference backend's, the torch path of layers/attention/sinks.py (itself
checked against a naive softmax in tests/models/test_gpt_oss.py): prompts and continuation chunks, windows shorter and longer than the query
blocks and key steps of 32, decodes whose contexts are split over the threads, grouped-query heads; bad
sinks and windows are refused by name."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.attention import get_backend
from tokenmill.platforms import cpu_native
from test_attention import decode_step, needs_native_prefill, prefill_step  # tests/layers, on sys.path

pytestmark = needs_native_prefill
WINDOWS = [None, 1, 5, 40, 128]


def _both_paths(q, k, v, kc, vc, meta, scale, sinks, window):
    """(the CPU backend's output, the reference backend's), each writing k, v into its own copy of the caches."""
    native = get_backend("cpu").forward_with_sinks(q, k, v, kc.clone(), vc.clone(), meta, scale, sinks, window)
    reference = get_backend("reference").forward_with_sinks(q, k, v, kc.clone(), vc.clone(), meta, scale, sinks,
                                                            window)
    return native, reference


@pytest.mark.parametrize("chunks", [[(0, 130)], [(0, 33), (64, 31), (5, 97)], [(200, 70), (0, 128)]])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", WINDOWS)
def test_native_prefill_with_sinks_and_windows_is_the_torch_path(chunks, head_dim, window, monkeypatch):
    q, k, v, kc, vc, meta = prefill_step(chunks, 2, 3, head_dim, seed=len(chunks) + head_dim)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(head_dim)) * 3
    calls, real = [], cpu_native.load().prefill_attention
    monkeypatch.setattr(cpu_native.load(), "prefill_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    native, reference = _both_paths(q, k, v, kc, vc, meta, head_dim ** -0.5, sinks, window)
    assert len(calls) == 1 and calls[0]["window"] == (window or 0)
    assert (native - reference).abs().max() < 1e-5


@pytest.mark.parametrize("context_lens", [[1], [5], [300], [1, 700], [4] * 9])
@pytest.mark.parametrize("window", WINDOWS)
def test_native_decode_with_sinks_and_windows_is_the_torch_path(context_lens, window):
    q, k, v, kc, vc, meta = decode_step(context_lens, 3, 3, 64, seed=len(context_lens))
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(1)) * 3
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):                       # batch 1-2: each context's window split over 2 x n chunks
            torch.set_num_threads(n)
            native, reference = _both_paths(q, k, v, kc, vc, meta, 0.125, sinks, window)
            assert (native - reference).abs().max() < 1e-5, n
    finally:
        torch.set_num_threads(threads)


def test_a_sink_far_above_every_score_takes_all_the_weight():
    """exp(sink - m) where the sink is the maximum: the output goes to 0 without overflowing to NaN."""
    q, k, v, kc, vc, meta = decode_step([50, 3], 1, 2, 64)
    native, reference = _both_paths(q, k, v, kc, vc, meta, 0.125, torch.tensor([200.0, 0.0]), None)
    assert torch.isfinite(native).all() and native.view(2, 2, 64)[:, 0].abs().max() < 1e-30
    assert (native - reference).abs().max() < 1e-5


def test_bad_sinks_and_windows_are_refused_by_name():
    native = cpu_native.load()
    q, kc = torch.randn(2, 4, 64), torch.randn(2, 16, 64)
    slots, lens = torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 2])
    with pytest.raises(RuntimeError, match=r"sinks must be float32 \[4\]"):
        native.paged_decode_attention(q, kc, kc, slots, lens, 0.1, sinks=torch.zeros(2))
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        native.paged_decode_attention(q, kc, kc, slots, lens, 0.1, window=-1)
    out = torch.empty_like(q)
    spans = torch.tensor([[0, 2, 2]])
    with pytest.raises(RuntimeError, match=r"sinks must be float32 \[4\]"):
        native.prefill_attention(q, kc, kc, spans, slots[:1], 0.1, out, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        native.prefill_attention(q, kc, kc, spans, slots[:1], 0.1, out, window=-3)
