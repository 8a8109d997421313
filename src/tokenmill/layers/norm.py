"""RMSNorm, with the platform's kernel (CPU float32: one native pass that adds the residual in place
first; elsewhere torch's fused rms_norm)."""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.platforms import op_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.kernel = op_kernels().rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [num_tokens, hidden]. With `residual`, returns (norm(x + residual), x + residual); the sum may
        be written into `residual` itself (callers pass this step's own tensors and use only the results)."""
        return self.kernel(x, residual, self.weight, self.eps)
