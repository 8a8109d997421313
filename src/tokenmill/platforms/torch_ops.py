"""Portable kernels in plain torch: what every platform falls back to and what the native ones must equal.

Each takes and returns tensors on any device, in any float dtype; shapes as in platforms/base.py OpKernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x [T, hidden] -> norm(x), or with `residual` (norm(x + residual), x + residual). Below float32 the
    normalization runs in float32 and the weight multiplies the result cast back, as Hugging Face does."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32:
        out = F.rms_norm(x, weight.shape, weight, eps)
    else:
        xf = x.float()
        out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, heads, head_dim], k [T, kv_heads, head_dim], cos/sin [T, head_dim // 2] -> rotated (q, k)
    in Hugging Face's "rotate half" layout (new tensors). cos/sin are cast to q's dtype first, as HF does."""
    cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)    # [T, 1, head_dim // 2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
