"""Activation quantization as a pre-quantized checkpoint declares it (W8A8 FP8, W4A4 NVFP4 / MXFP4), computed
exactly on hardware without FP8 / FP4 arithmetic: a linear layer's input is rounded to the values its codes
would hold, then multiplied in float32 with the weight's codes (quant/fp8.py, quant/fp4.py). The product is
what an FP8 / FP4 GEMM with float32 accumulation gives, so this is the format's exact reference.

    fp8 / tensor   static:  x ~= E4M3(x / s) * s, s the checkpoint's `input_scale` (clamped to +-448 s)
    fp8 / token    dynamic: s = amax(row) / 448, per row
    fp8 / group    dynamic: s = amax(row, group of `group` inputs) / 448 (DeepSeek-V3: 128)
    nvfp4          dynamic blocks of 16 under a static global scale g (a multiplier, g = amax / (6 x 448)):
                   block scale b = E4M3(amax(block) / 6 / g) (at most 448), x ~= E2M1(x / (b g)) * b g
    mxfp4          dynamic blocks of 32: scale 2^(floor(log2 amax(block)) - 2) (an E8M0 exponent),
                   x ~= E2M1(x / scale) * scale

A zero scale (an all-zero row, group or block) gives zeros. Inputs are float32 [T, K]."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.quant.fp4 import E2M1_MAX, E4M3_MAX, e8m0_to_float, from_e2m1, mxfp4_exponents, to_e2m1

_TINY = torch.finfo(torch.float32).tiny

FORMATS = {"fp8": ("tensor", "token", "group"), "nvfp4": ("block",), "mxfp4": ("block",)}
BLOCK = {"nvfp4": 16, "mxfp4": 32}           # inputs per dynamic block scale of the FP4 formats


@dataclass(frozen=True)
class ActivationScheme:
    """How a checkpoint quantizes every quantized layer's input."""
    format: str              # "fp8" | "nvfp4" | "mxfp4"
    granularity: str         # fp8: "tensor" | "token" | "group"; FP4 formats: "block"
    group: int = 0           # inputs per scale of fp8 "group" (128), of FP4 blocks (16 / 32)

    def __post_init__(self) -> None:
        if self.granularity not in FORMATS.get(self.format, ()):
            raise ValueError(f"activation scheme {self.format}/{self.granularity} is not supported; supported: "
                             + ", ".join(f"{f}/{g}" for f, gs in FORMATS.items() for g in gs))

    @property
    def needs_static_scale(self) -> bool:
        """A scale per layer from the checkpoint: fp8's static tensor scale, NVFP4's global scale."""
        return (self.format, self.granularity) in (("fp8", "tensor"), ("nvfp4", "block"))

    def describe(self) -> str:
        per = {"tensor": "static per tensor", "token": "dynamic per token",
               "group": f"dynamic per token and {self.group} inputs", "block": f"dynamic per {self.group} inputs"}
        return f"{self.format} activations, {per[self.granularity]}"


@dataclass(frozen=True)
class InputQuant:
    """One layer's input rounding: its checkpoint's scheme and, where the scheme has one, the static scale
    (a float32 multiplier: fp8 x ~= code x scale; NVFP4's global scale amax / (6 x 448))."""
    scheme: ActivationScheme
    scale: float | None = None

    def __post_init__(self) -> None:
        if self.scheme.needs_static_scale and not (self.scale is not None and self.scale > 0):
            raise ValueError(f"{self.scheme.describe()} need a positive static scale, got {self.scale}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_dequantize(x, self.scheme, self.scale)


def quantize_dequantize(x: torch.Tensor, scheme: ActivationScheme, scale: float | None = None) -> torch.Tensor:
    """x [T, K] -> float32 [T, K]: the values x's codes under `scheme` stand for."""
    x = x.float()
    t, k = x.shape
    if scheme.format == "fp8":
        if scheme.granularity == "tensor":
            return fp8_static_codes(x, scale).float() * scale
        group = k if scheme.granularity == "token" else scheme.group
        codes, scales = fp8_codes(x, group)
        return (codes.float().view(t, k // group, group) * scales.unsqueeze(-1)).view(t, k)
    block = BLOCK[scheme.format]
    _check_blocks(k, block)
    xb = x.view(t, k // block, block)
    if scheme.format == "nvfp4":
        g = torch.tensor(scale, dtype=torch.float32)
        block_scale = (xb.abs().amax(dim=-1, keepdim=True) / E2M1_MAX / g).clamp(max=E4M3_MAX)
        return _e2m1_round(xb, block_scale.to(torch.float8_e4m3fn).float() * g).view(t, k)
    return _e2m1_round(xb, e8m0_to_float(mxfp4_exponents(x)).unsqueeze(-1)).view(t, k)


def fp8_codes(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8: x [M, K] -> (E4M3 codes [M, K], float32 scales [M, K / group]), scale = amax / 448 per
    (row, group of inputs); x ~= codes * scale (an all-zero group: codes 0)."""
    m, k = x.shape
    _check_blocks(k, group)
    xg = x.float().reshape(m, k // group, group)
    scale = (xg.abs().amax(dim=2) / E4M3_MAX).clamp_min(_TINY)
    codes = (xg / scale.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(m, k), scale


def fp8_static_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Static FP8: x [M, K] / scale rounded to E4M3 (nearest, ties to even, saturating at +-448)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _check_blocks(k: int, block: int) -> None:
    if k % block:
        raise ValueError(f"block-wise activation quantization needs the input width {k} to be a multiple of {block}")


def _e2m1_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to E2M1, times scale; 0 where the scale is 0 (an all-zero NVFP4 block)."""
    safe = scale.clamp_min(_TINY)
    q = from_e2m1(to_e2m1(x / safe)) * safe
    return torch.where(scale > 0, q, torch.zeros((), dtype=q.dtype))
