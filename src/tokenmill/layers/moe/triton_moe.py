"""A grouped GEMM for MoE experts in Triton: rows of x, each bound for one expert, times that expert's
weight, every expert in one launch. Runs on CUDA, and on the CPU under TRITON_INTERPRET=1 (tests).

Layout (sort_rows_by_expert, torch ops on the device, no host sync so a CUDA graph can hold it): the rows
sorted by expert, each expert's run padded to a multiple of BLOCK_M, the padding pointing at row N (none);
`block_expert[b]` is the expert of padded block b (num_experts past the last real block). The number of
blocks is the static bound ceil((N + E * (BLOCK_M - 1)) / BLOCK_M), so the grid depends on N only.
A program computes BLOCK_M rows x BLOCK_N outputs of one expert, reading its weight tile once for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@dataclass(frozen=True)
class ExpertRows:
    num_rows: int                  # N
    sorted_rows: torch.Tensor      # [num_blocks * BLOCK_M] int32: a row of x, or N (padding)
    block_expert: torch.Tensor     # [num_blocks] int32: local expert, or num_experts (no work)


def sort_rows_by_expert(experts: torch.Tensor, num_experts: int) -> ExpertRows:
    """experts [N] int64 in [0, num_experts) -> the padded, sorted layout above."""
    n, device = experts.shape[0], experts.device
    num_blocks = -(-(n + num_experts * (BLOCK_M - 1)) // BLOCK_M)
    counts = torch.bincount(experts, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(experts, stable=True)
    sorted_experts = experts[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(n, device=device) - first_of_expert[sorted_experts]
    position = (padded_end - padded)[sorted_experts] + rank_in_expert
    sorted_rows = torch.full((num_blocks * BLOCK_M,), n, dtype=torch.int32, device=device)
    sorted_rows[position] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * BLOCK_M
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)  # E past the end
    return ExpertRows(n, sorted_rows, block_expert)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_matmul_kernel(x_ptr, w_ptr, y_ptr, rows_ptr, block_expert_ptr, num_rows, N, K, num_experts,
                              stride_xm, stride_we, stride_wn, stride_ym,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              PRECISION: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < num_experts:
            rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
            rmask = rows < num_rows
            rows = rows.to(tl.int64)                  # int64 offsets: experts x N x K can pass 2^31 elements
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = rn < N
            w_cols = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn   # [1, BLOCK_N]
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                kmask = rk < K
                a = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
                w = tl.load(w_cols + rk[:, None],
                            mask=nmask[None, :] & kmask[:, None], other=0.0)              # [BLOCK_K, BLOCK_N]
                acc += tl.dot(a, w, input_precision=PRECISION)
            tl.store(y_ptr + rows[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=rmask[:, None] & nmask[None, :])

    return triton, grouped_matmul_kernel


_COMPILED = None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, layout: ExpertRows) -> torch.Tensor:
    """x [N, K]; w [E, N_out, K] (each expert's weight, as a Linear holds it) -> y [N, N_out] with
    y[i] = x[i] @ w[expert of row i]^T, in x's dtype."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = _kernel()
    triton, kernel = _COMPILED
    x, w = x.contiguous(), w.contiguous()
    n_out, k = w.shape[1], w.shape[2]
    y = torch.empty(x.shape[0], n_out, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    grid = (layout.block_expert.shape[0], triton.cdiv(n_out, BLOCK_N))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    kernel[grid](x, w, y, layout.sorted_rows, layout.block_expert, layout.num_rows, n_out, k, w.shape[0],
                 x.stride(0), w.stride(0), w.stride(1), y.stride(0),
                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=precision)
    return y
