"""Gated MLP activations: [T, 2I] as [gate | up] -> act(gate) * up [T, I], act the HF config's hidden_act
(config.HIDDEN_ACTS), each as transformers' ACT2FN computes it. SiLU is the platform's kernel (native on the
CPU); the others are torch ops."""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.config import HIDDEN_ACTS
from tokenmill.platforms import op_kernels


def _gelu_and_mul(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


_TORCH = {"gelu": partial(_gelu_and_mul, approximate="none"),            # erf, transformers' GELUActivation
          "gelu_pytorch_tanh": partial(_gelu_and_mul, approximate="tanh")}


def gated_activation(hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """act_and_mul for `hidden_act`; "silu" / "swish" are the platform's silu_and_mul (built inside
    platforms.building, as every layer)."""
    if hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(HIDDEN_ACTS)}")
    if hidden_act in ("silu", "swish"):
        return op_kernels().silu_and_mul
    return _TORCH[hidden_act]
