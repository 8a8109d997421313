"""RMSNorm in float32: one native pass (adding the residual in place first) where the native kernels are
built, else torch's fused rms_norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.native = cpu_kernels.load()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [num_tokens, hidden]. With `residual`, returns (norm(x + residual), x + residual); the sum may
        be written into `residual` itself (callers pass this step's own tensors and use only the results)."""
        if self.native is not None and x.dtype == torch.float32 and not x.is_cuda and x.dim() == 2:
            if residual is not None and residual.is_contiguous():
                return self.native.rms_norm(x, residual, self.weight, self.eps), residual
            if residual is None:
                return self.native.rms_norm(x, None, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if residual is None else (out, residual)
