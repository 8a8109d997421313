"""Float weights on CUDA (bfloat16 / float16 / float32): F.linear, i.e. cuBLAS, over the weight as
loaded onto the device. Nothing to pack."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.quant.base import QuantMethod


class CUDAFloatMethod(QuantMethod):
    name = "float"
    platform = "cuda"
    is_float = True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)
