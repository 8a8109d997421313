"""The native CPU kernels (src/tokenmill/csrc) on non-finite inputs and on arguments they cannot take: a NaN
reaches the outputs torch's own ops give NaN for (attention: exp16 lets NaN through; int8 / int4 / NVFP4
linears: a group of activations holding NaN or inf makes its row NaN instead of an integer's garbage), and
the attention, KV-cache write and MoE / FP8 linear wrappers refuse out-of-range or mismatched arguments with
a RuntimeError naming them, where they read or wrote out of bounds (or gave garbage) before."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tokenmill.platforms import cpu_native

native = cpu_native.load()
pytestmark = pytest.mark.skipif(native is None, reason="needs the native CPU build (a compiler)")

NAN, INF = float("nan"), float("inf")


def _has(name: str):
    return pytest.mark.skipif(native is None or not hasattr(native, name), reason=f"this build has no {name}")


def _sdpa_decode(q, k_cache, v_cache, slots, lens, scale):
    """torch's attention of each row's one query over its context (all of it: the query is the last position)."""
    out = []
    for r in range(q.shape[0]):
        n = int(lens[r])
        k = k_cache[:, slots[r, :n]][None]                         # [1, KV, n, D]
        v = v_cache[:, slots[r, :n]][None]
        out.append(F.scaled_dot_product_attention(q[r][None, :, None], k, v, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def _assert_same_nans(out, ref):
    assert ref.isnan().any()
    assert torch.equal(out.isnan(), ref.isnan())
    finite = ~ref.isnan()
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-4, atol=1e-5)


# ---- C1: a NaN score propagates through the vectorized softmax (decode and prefill), as in torch ----

@pytest.mark.parametrize("head_dim", [64, 128, 80])              # 64 / 128 vectorized (AVX-512), 80 portable
@pytest.mark.parametrize("rows,kv_heads", [(1, 1), (8, 2)])      # batch 1 with one kv head: the split path
def test_nan_key_row_gives_nan_decode_outputs_where_torch_does(rows, kv_heads, head_dim):
    torch.manual_seed(0)
    H, S, L = 4, 96, 40
    k_cache, v_cache = torch.randn(kv_heads, S, head_dim), torch.randn(kv_heads, S, head_dim)
    slots = torch.stack([torch.randperm(S)[:L] for _ in range(rows)])
    lens = torch.tensor([L - 3 * (r % 4) for r in range(rows)])
    k_cache[0, slots[0, 5], 3] = NAN                             # row 0's position 5, kv head 0 (others may share it)
    if rows > 1:
        slots[1, : int(lens[1])] = torch.randperm(S)[: int(lens[1])]   # a row that may or may not read it
    q = torch.randn(rows, H, head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = native.paged_decode_attention(q, k_cache, v_cache, slots, lens, scale)
    _assert_same_nans(out, _sdpa_decode(q, k_cache, v_cache, slots, lens, scale))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_nan_key_row_outside_the_window_or_in_padding_is_not_read(head_dim):
    torch.manual_seed(1)
    H, KV, S, L = 4, 2, 64, 30
    k_cache, v_cache = torch.randn(KV, S, head_dim), torch.randn(KV, S, head_dim)
    slots = torch.arange(L)[None].repeat(2, 1)
    lens = torch.tensor([L, 10])
    k_cache[0, 12] = NAN                           # row 0: before its window of 8; row 1: past its length
    q = torch.randn(2, H, head_dim)
    out = native.paged_decode_attention(q, k_cache, v_cache, slots, lens, 0.1, window=8)
    assert out.isfinite().all()


@pytest.mark.skipif(native is None or not native.prefill_attention_supports(64), reason="prefill needs AVX-512")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_nan_key_row_gives_nan_prefill_outputs_where_torch_does(head_dim):
    torch.manual_seed(3)
    H, KV, T = 4, 2, 40
    k_cache, v_cache = torch.randn(KV, 48, head_dim), torch.randn(KV, 48, head_dim)
    k_cache[0, 5, 0] = NAN                                     # position 5 of kv head 0: rows >= 5 of heads 0, 1
    q = torch.randn(T, H, head_dim)
    out = torch.zeros(T, H, head_dim)
    native.prefill_attention(q, k_cache, v_cache, torch.tensor([[0, T, T]]), torch.arange(T)[None], 0.125, out)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_cache[:, :T][None], v_cache[:, :T][None],
                                         is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
    _assert_same_nans(out, ref)
    assert out[:5].isfinite().all() and out[5:, 2:].isfinite().all() and out[5:, :2].isnan().all()


# ---- C2: int8 / int4 / NVFP4 linears: a non-finite activation makes its row NaN, other rows untouched ----

def _int_linears(N: int, K: int):
    from tokenmill.quant import fp4
    from tokenmill.quant.int4 import pack_q4_tiles, quantize_groupwise_int4
    from tokenmill.quant.int8 import pack_q8_tiles, quantize_per_channel_int8
    torch.manual_seed(5)
    w = torch.randn(N, K)
    q8, s8 = quantize_per_channel_int8(w)
    t8, ts8 = pack_q8_tiles(q8, s8)
    q4, sc, z = quantize_groupwise_int4(w)
    t4 = pack_q4_tiles(q4, sc, z - 8 * sc)
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8)
    tf, rf = fp4.pack_nvfp4_tiles(fp4.pack(codes), (torch.rand(N, K // 16) * 4 + 0.5).to(torch.float8_e4m3fn),
                                  torch.rand(N) + 0.5)
    return {"q8": lambda x: native.gemv_q8(x, t8, ts8, N), "q4": lambda x: native.gemv_q4(x, t4, N),
            "nvfp4": lambda x: native.gemv_nvfp4(x, tf, rf, N)}


@_has("gemv_q8")
@pytest.mark.parametrize("kind", ["q8", "q4", "nvfp4"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("rows", [1, 3, 9])                      # tiles of 1, 3, 4 / 6 rows and a tail
def test_non_finite_activation_gives_a_nan_row(kind, bad, rows):
    N, K = 40, 96
    linear = _int_linears(N, K)[kind]
    torch.manual_seed(rows)
    x = torch.randn(rows, K)
    clean = linear(x.clone())
    r = rows // 2
    x[r, 37] = bad                                               # group 1 of row r
    y = linear(x)
    assert y[r].isnan().all()
    others = torch.arange(rows) != r
    assert torch.equal(y[others], clean[others])
    torch_ref = x @ torch.randn(N, K).T
    assert not torch_ref[r].isfinite().any()                     # torch: no finite output in that row either


@_has("gemv_q8")
@pytest.mark.parametrize("kind", ["q8", "q4", "nvfp4"])
def test_groups_of_tiny_activations_quantize_as_zeros(kind):
    """Magnitudes below ~3.7e-37 (1 / scale overflows): the groups read as zeros, not as -128s."""
    linear = _int_linears(32, 64)[kind]
    torch.manual_seed(7)
    x = torch.randn(2, 64)
    zeroed = x.clone()
    x[0] = torch.randn(64) * 1e-38
    zeroed[0] = 0
    y = linear(x)
    assert torch.equal(y, linear(zeroed)) and not y[0].any()


# ---- C3: decode attention refuses slots, lengths and caches it would read out of bounds ----

def _decode_args(fp8: bool):
    KV, S, D, H = 2, 32, 64, 4
    k_cache, v_cache = torch.randn(KV, S, D), torch.randn(KV, S, D)
    if fp8:
        k_cache, v_cache = (c.to(torch.float8_e4m3fn).view(torch.uint8) for c in (k_cache, v_cache))
    return torch.randn(1, H, D), k_cache, v_cache, torch.arange(8)[None], torch.tensor([8])


def _decode(fp8, q, k_cache, v_cache, slots, lens):
    if fp8:
        KV = k_cache.shape[0]
        return native.paged_decode_attention_fp8(q, k_cache, v_cache, slots, lens, 0.1, torch.ones(KV), torch.ones(KV))
    return native.paged_decode_attention(q, k_cache, v_cache, slots, lens, 0.1)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_refuses_a_slot_out_of_range(fp8):
    name = "paged_decode_attention_fp8" if fp8 else "paged_decode_attention"
    q, kc, vc, slots, lens = _decode_args(fp8)
    for bad in (10**6, 32, -1):
        s = slots.clone()
        s[0, 3] = bad
        with pytest.raises(RuntimeError, match=rf"{name}: slot out of range: slots\[0, 3\] = {bad}, "
                                               r"expected 0 <= slot < 32"):
            _decode(fp8, q, kc, vc, s, lens)
    s = torch.cat([slots, torch.full((1, 4), -1)], 1)            # padding past lens is never read: accepted
    torch.testing.assert_close(_decode(fp8, q, kc, vc, s, lens), _decode(fp8, q, kc, vc, slots, lens))


def test_decode_attention_checks_only_the_window_it_reads():
    q, kc, vc, slots, lens = _decode_args(False)
    s = slots.clone()
    s[0, 0] = 10**6                                              # before the window of 4: never read
    torch.testing.assert_close(native.paged_decode_attention(q, kc, vc, s, lens, 0.1, window=4),
                               native.paged_decode_attention(q, kc, vc, slots, lens, 0.1, window=4))
    s[0, 5] = 10**6
    with pytest.raises(RuntimeError, match=r"slot out of range: slots\[0, 5\] = 1000000"):
        native.paged_decode_attention(q, kc, vc, s, lens, 0.1, window=4)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("length", [0, 9, -2])
def test_decode_attention_refuses_lengths_outside_the_slot_table(fp8, length):
    q, kc, vc, slots, _ = _decode_args(fp8)
    with pytest.raises(RuntimeError, match=rf"lens\[0\] = {length}, expected 1 <= lens <= 8"):
        _decode(fp8, q, kc, vc, slots, torch.tensor([length]))


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_attention_refuses_mismatched_caches_and_tables(fp8):
    q, kc, vc, slots, lens = _decode_args(fp8)
    for other in (vc[:, :4].contiguous(), vc[..., :32].contiguous(), vc[:1].contiguous()):
        with pytest.raises(RuntimeError, match=r"v_cache must have k_cache's sizes \[2, 32, 64\], got"):
            _decode(fp8, q, kc, other, slots, lens)
    with pytest.raises(RuntimeError, match=r"slots must be \[1, L\]"):
        _decode(fp8, q, kc, vc, slots.repeat(2, 1), lens)
    with pytest.raises(RuntimeError, match=r"lens must be \[1\]"):
        _decode(fp8, q, kc, vc, slots, lens.repeat(2))
    with pytest.raises(RuntimeError, match=r"k_cache's head dim must be q's 32, got 64"):
        _decode(fp8, q[..., :32].contiguous(), kc, vc, slots, lens)
    with pytest.raises(RuntimeError, match=r"3 heads must be a multiple of the cache's 2 kv heads"):
        _decode(fp8, q[:, :3].contiguous(), kc, vc, slots, lens)


# ---- C4: the KV-cache writes refuse mismatched shapes and slots out of range ----

def test_write_kv_cache_refuses_mismatched_shapes_and_slots():
    KV, S, D = 2, 32, 64
    kc, vc = torch.zeros(KV, S, D), torch.zeros(KV, S, D)
    k, v, slots = torch.randn(4, KV, D), torch.randn(4, KV, D), torch.tensor([0, 1, 2, 31])
    cases = [
        ((k[:, 0], v[:, 0], kc, vc, slots), r"k must be \[T, KV, D\], got \[4, 64\]"),
        ((k, v[:1], kc, vc, slots), r"v must have k's sizes \[4, 2, 64\], got \[1, 2, 64\]"),
        ((torch.randn(4, KV, 128),) * 2 + (kc, vc, slots),
         r"k \[T, KV, D\] = \[4, 2, 128\] must match the cache's \[KV, S, D\] = \[2, 32, 64\] in kv heads"),
        ((torch.randn(4, 3, D),) * 2 + (kc, vc, slots), r"k \[T, KV, D\] = \[4, 3, 64\] must match"),
        ((k, v, kc, torch.zeros(KV, 4, D), slots),
         r"v_cache must have k_cache's sizes \[2, 32, 64\], got \[2, 4, 64\]"),
        ((k, v, kc[0], vc[0], slots), r"k_cache must be \[KV, S, D\], got \[32, 64\]"),
        ((k, v, kc, vc, slots[:2]), r"slots must be \[4\] \(one per token of k\), got \[2\]"),
        ((k, v, kc, vc, torch.tensor([0, 1, 32, 3])), r"slot out of range: slots\[2\] = 32, expected 0 <= slot < 32"),
        ((k, v, kc, vc, torch.tensor([0, -1, 2, 3])), r"slot out of range: slots\[1\] = -1, expected 0 <= slot < 32"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=rf"write_kv_cache: {message}"):
            native.write_kv_cache(*args)
    assert not kc.any() and not vc.any()                         # nothing written by a refused call
    native.write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc[:, slots].transpose(0, 1), k) and torch.equal(vc[:, slots].transpose(0, 1), v)


def test_write_kv_cache_fp8_refuses_values_shaped_unlike_the_keys():
    KV, S, D = 2, 32, 64
    kc, vc = torch.zeros(KV, S, D, dtype=torch.uint8), torch.zeros(KV, S, D, dtype=torch.uint8)
    one_head = torch.zeros(1, S, D, dtype=torch.uint8)           # v and its cache agree, but not with k
    with pytest.raises(RuntimeError, match=r"write_kv_cache_fp8: v must have k's sizes \[2, 2, 64\], got \[2, 1, 64\]"):
        native.write_kv_cache_fp8(torch.randn(2, KV, D), torch.randn(2, 1, D), kc, one_head, torch.tensor([0, 1]),
                                  torch.ones(KV), torch.ones(1))
    with pytest.raises(RuntimeError, match=r"write_kv_cache_fp8: slot out of range: slots\[1\] = 32, "
                                           r"expected 0 <= slot < 32"):
        native.write_kv_cache_fp8(torch.randn(2, KV, D), torch.randn(2, KV, D), kc, vc, torch.tensor([0, 32]),
                                  torch.ones(KV), torch.ones(KV))
    assert not kc.any() and not vc.any() and not one_head.any()


# ---- C5 / C6: the grouped GEMM and the bfloat16 FP8 linear refuse what they would compute wrong ----

@_has("moe_grouped_gemm")
def test_moe_grouped_gemm_refuses_decreasing_run_starts_and_unused_scales():
    torch.manual_seed(2)
    x, w = torch.randn(4, 16), torch.randn(2, 8, 16)
    with pytest.raises(RuntimeError, match=r"run_starts must be non-decreasing, got run_starts\[1\] = 6 > "
                                           r"run_starts\[2\] = 4"):
        native.moe_grouped_gemm(x, torch.tensor([0, 6, 4]), w, None)
    with pytest.raises(RuntimeError, match=r"run_starts must go from 0 to the rows of x \(4\)"):
        native.moe_grouped_gemm(x, torch.tensor([0, 2, 5]), w, None)
    with pytest.raises(RuntimeError, match=r"float32 weights take no scale or row_scale .* got a scale"):
        native.moe_grouped_gemm(x, torch.tensor([0, 3, 4]), w, torch.ones(2, 8, 1))
    with pytest.raises(RuntimeError, match=r"float32 weights take no scale or row_scale .* got a row_scale"):
        native.moe_grouped_gemm(x, torch.tensor([0, 3, 4]), w, None, row_scale=torch.ones(2, 8))
    y = native.moe_grouped_gemm(x, torch.tensor([0, 3, 4]), w, None)
    ref = torch.cat([x[:3] @ w[0].T, x[3:] @ w[1].T])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@_has("fp8_linear_bf16")
def test_fp8_linear_bf16_refuses_blocks_its_scales_cannot_follow():
    torch.manual_seed(0)
    N, K = 16, 96
    x, codes = torch.randn(4, K), (torch.randn(N, K) * 10).to(torch.float8_e4m3fn)
    for kblock in (24, 8, 40):
        scales = torch.rand(N, -(-K // kblock)) + 0.1
        with pytest.raises(RuntimeError, match=rf"fp8_linear_bf16: kblock must be K \(96\) or a multiple of 16, "
                                               rf"got {kblock}"):
            native.fp8_linear_bf16(x, codes, scales, kblock)
    for kblock in (32, 128, K):
        scales = torch.rand(N, -(-K // kblock)) + 0.1
        w = codes.float() * scales.repeat_interleave(kblock, 1)[:, :K]
        ref = x.double() @ w.double().T
        y = native.fp8_linear_bf16(x, codes, scales, kblock)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 0.01     # bfloat16 activations
