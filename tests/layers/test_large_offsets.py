"""The Triton kernels address past 2^31 elements: a kv head's base (kv head x stride) in the attention
kernels, an expert's (expert x stride) in the MoE grouped GEMM. Only a GPU shows it (the interpreter's
pointers are 64-bit), and it takes GiBs: the big cases are marked `gpu` (benchmarks/gpu/check.sh runs this
file last); the same checks run small everywhere (under Triton's interpreter without a GPU), which tests
the checks themselves."""
from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: kernels run on the CPU


def _free(need_gib: float = 0.0) -> None:
    """Give back what earlier tests left; skip, saying so, when the device still lacks need_gib."""
    gc.collect()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0] / 2 ** 30 if need_gib else 0.0
    if free < need_gib:
        pytest.skip(f"needs {need_gib:.0f} GiB of free GPU memory, {free:.1f} GiB free (an earlier test's engine "
                    "still holds its KV pool?)")


def _dtype(device: str) -> torch.dtype:
    """bfloat16 on the GPU (half the GiBs); float32 under the interpreter (its bfloat16 tl.dot gives wrong sums)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def _attention_offsets(device: str, num_slots: int) -> None:
    """The kernels over a cache of 3 kv heads x num_slots x 128, reading the pool's last blocks, against the
    same kernels over a compact copy of those blocks: identical outputs."""
    from tokenmill.layers.attention.triton_kernels import paged_decode_attention, paged_prefill_attention
    kv_heads, group, head_dim, block_size = 3, 2, 128, 16
    num_blocks = num_slots // block_size
    g = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.empty(kv_heads, num_slots, head_dim, dtype=_dtype(device), device=device)
    v_cache = torch.empty_like(k_cache)
    context_lens = [37, 100]
    need = [-(-n // block_size) for n in context_lens]
    blocks = torch.arange(num_blocks - sum(need), num_blocks, device=device)            # the pool's last blocks
    tables = torch.zeros(len(context_lens), max(need), dtype=torch.long, device=device)
    tables[0, :need[0]], tables[1, :need[1]] = blocks[:need[0]], blocks[need[0]:]
    slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size, device=device)).view(-1)
    for cache in (k_cache, v_cache):
        cache[:, slots] = torch.randn(kv_heads, slots.numel(), head_dim, generator=g, device=device).to(cache.dtype)
    small_tables = tables - (num_blocks - sum(need))               # the same blocks, numbered from 0
    k_small, v_small = k_cache[:, slots].contiguous(), v_cache[:, slots].contiguous()
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(context_lens), kv_heads * group, head_dim, generator=g, device=device).to(k_cache.dtype)
    big = paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, 0.1, num_splits=2)
    small = paged_decode_attention(q, k_small, v_small, small_tables, lens, block_size, 0.1, num_splits=2)
    torch.testing.assert_close(big, small, rtol=0, atol=0)
    assert big.float().abs().sum() > 0
    qlens = [5, 100]
    qp = torch.randn(sum(qlens), kv_heads * group, head_dim, generator=g, device=device).to(k_cache.dtype)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    args = (as_tensor([0, qlens[0]]), as_tensor(qlens), lens, block_size, 0.1, max(qlens))
    big = paged_prefill_attention(qp, k_cache, v_cache, tables, *args)
    small = paged_prefill_attention(qp, k_small, v_small, small_tables, *args)
    torch.testing.assert_close(big, small, rtol=0, atol=0)


@pytest.mark.gpu
def test_attention_kernels_address_kv_heads_past_2_31_elements():
    """3 kv heads of 2^23 slots x 128 (12 GiB in all): the third head starts at element 2^31, where an int32
    kvh * stride_kh wraps (stride_kh = 2^30 itself fits int32, so Triton passes it as one)."""
    _free(need_gib=13)
    _attention_offsets("cuda", 2 ** 23)
    _free()


def test_the_kv_head_offset_check_itself():
    _attention_offsets("cuda" if torch.cuda.is_available() else "cpu", 2 ** 10)


def _moe_offsets(device: str, n_out: int, k: int) -> None:
    """Rows of 3 experts [3, n_out, k] through the grouped GEMM against float32 matmuls of their experts."""
    from tokenmill.layers.moe.triton_moe import grouped_matmul, sort_rows_by_expert
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.empty(3, n_out, k, dtype=_dtype(device), device=device)
    for e in range(3):
        w[e].normal_(generator=g)
    x = torch.randn(6, k, generator=g, device=device).to(w.dtype)
    experts = torch.tensor([2, 0, 1, 2, 1, 2], device=device)
    y = grouped_matmul(x, w, sort_rows_by_expert(experts, 3))
    ref = torch.stack([w[int(e)].float() @ x[i].float() for i, e in enumerate(experts.tolist())])
    rel = ((y.float() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
    assert rel < 1e-2, f"relative error {rel:.3g} (rows of expert 2 read another expert's weights?)"


@pytest.mark.gpu
def test_moe_grouped_gemm_addresses_experts_past_2_31_elements():
    """3 experts of 2^15 x 2^15 (6 GiB): the third starts at element 2^31 (expert * stride_we in int32 wraps)."""
    _free(need_gib=11)
    _moe_offsets("cuda", 2 ** 15, 2 ** 15)
    _free()


def test_the_expert_offset_check_itself():
    _moe_offsets("cuda" if torch.cuda.is_available() else "cpu", 64, 64)
