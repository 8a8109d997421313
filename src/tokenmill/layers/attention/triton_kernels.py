"""Triton kernels for paged attention over block tables: the CUDA path's attention, also runnable on the
CPU under TRITON_INTERPRET=1 (how the tests check them against the reference backend).

Cache layout (see base.py): k_cache, v_cache [num_kv_heads, num_slots, head_dim]; position p of sequence b
lives in slot block_tables[b, p // block_size] * block_size + p % block_size.

- `paged_decode_attention`: one query token per sequence. Grid (sequence, kv head, context split): each
  program reads one kv head's blocks once for all the query heads of its group (GQA) and keeps an online
  softmax over its share of the context; a second kernel merges the splits (flash-decoding), so a long
  context is spread over many programs even at batch 1.
- `paged_prefill_attention`: the multi-token chunks of a step in one launch. Grid (sequence, query block,
  head): causal attention of the chunk's new tokens against their whole context (cached prefix and the
  chunk itself), variable lengths, keys gathered through the block table.
Both accumulate in float32 and return q's dtype. An FP8 cache (kv_cache_dtype="fp8") is read as its bytes
and decoded in the kernels (_e4m3_to_float), times its per-kv-head scale. Both take gpt-oss's attention
too: `sinks` (a float32 logit per query head that joins each softmax and gives no value: its exp(sink - m)
is added to the denominator at the end) and `window` (a query at position p reads p - window + 1 .. p;
blocks wholly before the window are not read).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE_TOKENS_PER_SPLIT = 256     # context positions per decode program, roughly (whole blocks)
MAX_DECODE_SPLITS = 64
PREFILL_BLOCK_M = 16              # query rows per prefill program
PREFILL_BLOCK_N = 16              # context positions per inner step


@triton.jit
def _e4m3_to_float(bits):
    """float8_e4m3fn bytes (uint8) -> float32 exactly: the 7 magnitude bits moved into float32's exponent and
    mantissa, times 2^120 to rebias the exponent (subnormals included), then the sign."""
    b = bits.to(tl.int32)
    magnitude = ((b & 0x7F) << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36   # 2^120
    return tl.where((b & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _cached(ptrs, mask, scale_ptr, FP8: tl.constexpr):
    """Cache values at ptrs as float32: FP8 codes times their kv head's scale, or the float values."""
    if FP8:
        return _e4m3_to_float(tl.load(ptrs, mask=mask, other=0)) * tl.load(scale_ptr)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, k_scale_ptr,
                         v_scale_ptr, stride_qb, stride_qh, stride_kh, stride_ks, stride_tb, scale, num_splits,
                         blocks_per_split, window, GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr,
                         BLOCK: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    head_base = kvh.to(tl.int64) * stride_kh        # int64: kv heads x slots x head_dim can pass 2^31
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D)
    t = tl.arange(0, BLOCK)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                other=0.0).to(tl.float32)                                           # [GROUP_P, D]
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D], tl.float32)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)                   # first position read
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BLOCK))
    first = tl.maximum(first, lo // BLOCK)
    for i in range(first, last):                      # every block here holds at least one position read
        pos = i * BLOCK + t
        valid = (pos < seq_len) & (pos >= lo)
        block = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
        offs = head_base + (block * BLOCK + t)[:, None] * stride_ks + d[None, :]
        k = _cached(k_ptr + offs, valid[:, None], k_scale_ptr + kvh, FP8)             # [BLOCK, D] float32
        v = _cached(v_ptr + offs, valid[:, None], v_scale_ptr + kvh, FP8)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                   # [GROUP_P, BLOCK]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split              # [GROUP_P]
    tl.store(m_ptr + row, m, mask=gmask)
    tl.store(l_ptr + row, l, mask=gmask)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, stride_ob, stride_oh, num_heads, num_splits,
                         SPLITS_P: tl.constexpr, D: tl.constexpr, HAS_SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, D)
    smask = s < num_splits
    row = (b * num_heads + h) * num_splits + s
    m = tl.load(m_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)   # [SPLITS_P, D]
    best = tl.max(m, axis=0)                          # finite: some split holds the last position
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - best))
    denominator = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(tl.load(sinks_ptr + h) - best)
    out = tl.sum(acc * w[:, None], axis=0) / denominator
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, num_splits: int | None = None, kv_scales=None,
                           sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence, its KV already in the cache); block_tables [B, max_blocks]
    int32/64; seq_lens [B] (>= 1, new token included). kv_scales: fp8_kv.KVScales of float8 caches, else
    None. sinks [H] float32 and window (None: all) as gpt-oss's attention. Returns [B, H, D] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    _check_shapes(q, k_cache, v_cache, block_tables, block_size)
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = min(MAX_DECODE_SPLITS, max(1, max_blocks * block_size // DECODE_TOKENS_PER_SPLIT))
    blocks_per_split = triton.cdiv(max_blocks, num_splits)
    partial = q.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
    m, l = partial, torch.empty_like(partial)
    acc = q.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
    k_cache, v_cache, k_scale, v_scale = _cache_operands(k_cache, v_cache, kv_scales)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, m, l, acc, k_scale, v_scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), scale, num_splits, blocks_per_split,
        window or 0, GROUP=group, GROUP_P=triton.next_power_of_2(group), D=head_dim, BLOCK=block_size,
        FP8=kv_scales is not None)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode_merge_kernel[(num_seqs, num_heads)](m, l, acc, out, _sinks_operand(sinks, m), out.stride(0), out.stride(1),
                                                num_heads, num_splits, SPLITS_P=triton.next_power_of_2(num_splits),
                                                D=head_dim, HAS_SINKS=sinks is not None)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, qlens_ptr, ctxlens_ptr, k_scale_ptr,
                    v_scale_ptr, sinks_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_ks,
                    stride_tb, scale, window, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, HAS_SINKS: tl.constexpr,
                    PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    qblock = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(qlens_ptr + seq)
    if qblock * BLOCK_M < q_len:
        q_start = tl.load(starts_ptr + seq)
        ctx_len = tl.load(ctxlens_ptr + seq)
        kvh = h // GROUP
        head_base = kvh.to(tl.int64) * stride_kh    # int64: kv heads x slots x head_dim can pass 2^31
        rows = qblock * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=rmask[:, None], other=0.0)                                   # [BLOCK_M, D]
        q_pos = ctx_len - q_len + rows                                                # absolute positions
        hi = tl.minimum(ctx_len, ctx_len - q_len + (qblock + 1) * BLOCK_M)            # causal end of the block
        lo = tl.where(window > 0, tl.maximum(ctx_len - q_len + qblock * BLOCK_M - window + 1, 0), 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pmask = pos < hi
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
            offs = head_base + (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_ks + d[None, :]
            k = _cached(k_ptr + offs, pmask[:, None], k_scale_ptr + kvh, FP8).to(q.dtype)  # [BLOCK_N, D]
            v = _cached(v_ptr + offs, pmask[:, None], v_scale_ptr + kvh, FP8).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale   # [BLOCK_M, BLOCK_N]
            keep = (pos[None, :] <= q_pos[:, None]) & pmask[None, :] & rmask[:, None]
            keep = keep & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                     # rows with nothing yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        if HAS_SINKS:
            l += tl.exp(tl.load(sinks_ptr + h) - m)                                   # padding rows: m = -inf
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, scale: float,
                            max_query_len: int, out: torch.Tensor | None = None, kv_scales=None,
                            sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, H, D]: the step's new tokens, sequence s owning rows query_starts[s] .. + query_lens[s], its
    KV (chunk included) already in the cache; context_lens[s] = start position + query_lens[s]. Writes the
    listed sequences' rows of `out` ([T, H, D], q's dtype; zeros when not given) and returns it; other rows
    are left as they are. sinks [H] float32 and window (None: all) as gpt-oss's attention."""
    num_tokens, num_heads, head_dim = q.shape
    _check_shapes(q, k_cache, v_cache, block_tables, block_size)
    if out is None:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    grid = (query_starts.shape[0], triton.cdiv(max_query_len, PREFILL_BLOCK_M), num_heads)
    k_cache, v_cache, k_scale, v_scale = _cache_operands(k_cache, v_cache, kv_scales)
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens,
                          k_scale, v_scale, _sinks_operand(sinks, q), q.stride(0), q.stride(1), out.stride(0),
                          out.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), scale,
                          window or 0, GROUP=num_heads // k_cache.shape[0], D=head_dim, BLOCK_SIZE=block_size,
                          BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, FP8=kv_scales is not None,
                          HAS_SINKS=sinks is not None, PRECISION=dot_precision(q.dtype))
    return out


def dot_precision(dtype: torch.dtype) -> str:
    """The prefill kernel's tl.dot input_precision for operands of `dtype`: "ieee" for float32 (Triton's default,
    "tf32", would round them to 10 mantissa bits on NVIDIA tensor cores: errors near 1e-3, which the
    interpreter does not show), "tf32" otherwise (ignored for 16-bit operands, which run at their own precision)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _sinks_operand(sinks: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them (float32, contiguous); without sinks, a tensor standing in (not
    read)."""
    return stand_in if sinks is None else sinks.to(stand_in.device, torch.float32).contiguous()


def _cache_operands(k_cache, v_cache, kv_scales):
    """(k, v, k_scale, v_scale) as the kernels take them: an FP8 cache as its bytes (uint8) with its per-kv-head
    scales; a float cache with its own tensor standing in for the scales (not read)."""
    if kv_scales is None:
        return k_cache, v_cache, k_cache, v_cache
    return (k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scales.k.to(k_cache.device, torch.float32),
            kv_scales.v.to(k_cache.device, torch.float32))


def _check_shapes(q, k_cache, v_cache, block_tables, block_size: int) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim or num_heads % k_cache.shape[0]:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)} (expected [kv_heads, slots, {head_dim}] with "
                         f"{num_heads} query heads a multiple of kv_heads)")
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim and block_size, got {head_dim} and "
                         f"{block_size}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches must be contiguous along head_dim, and both caches laid out alike")
