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

E4M3_MAX = 448.0
E2M1_MAX = 6.0
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
    if scheme.format == "fp8":
        if scheme.granularity == "tensor":
            return fp8_round(x, torch.tensor(scale))
        if scheme.granularity == "token":
            return fp8_round(x, x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX)
        return _by_blocks(x, scheme.group, lambda xb: fp8_round(xb, xb.abs().amax(dim=-1, keepdim=True) / E4M3_MAX))
    block = BLOCK[scheme.format]
    if scheme.format == "nvfp4":
        return _by_blocks(x, block, lambda xb: _nvfp4_round(xb, scale))
    return _by_blocks(x, block, _mxfp4_round)


def fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to E4M3 (nearest, ties to even, saturating at +-448), times scale; 0 where scale is 0."""
    safe = scale.clamp_min(_TINY)
    q = (x / safe).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * safe
    return torch.where(scale > 0, q, torch.zeros((), dtype=q.dtype))


def _by_blocks(x: torch.Tensor, block: int, fn) -> torch.Tensor:
    t, k = x.shape
    if k % block:
        raise ValueError(f"block-wise activation quantization needs the input width {k} to be a multiple of {block}")
    return fn(x.reshape(t, k // block, block)).reshape(t, k)


def _e2m1_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    from tokenmill.quant.fp4 import from_e2m1, to_e2m1
    safe = scale.clamp_min(_TINY)
    q = from_e2m1(to_e2m1(x / safe)) * safe
    return torch.where(scale > 0, q, torch.zeros((), dtype=q.dtype))


def _nvfp4_round(xb: torch.Tensor, global_scale: float) -> torch.Tensor:
    """xb [T, B, 16]; global_scale the multiplier g: block scale E4M3(amax / 6 / g), applied times g."""
    g = torch.tensor(global_scale, dtype=torch.float32)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    block = (amax / E2M1_MAX / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    return _e2m1_round(xb, block * g)


def _mxfp4_round(xb: torch.Tensor) -> torch.Tensor:
    """xb [T, B, 32]: scale 2^(floor(log2 amax) - 2), the exponent clamped to E8M0's range."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    exponent = (torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2).clamp(-127, 127)
    return _e2m1_round(xb, torch.where(amax > 0, torch.exp2(exponent), torch.zeros(())))
