"""FP8 E4M3 weights and activations through `torch._scaled_mm` (CUDA: FP8 tensor cores on Hopper and later).

    weights:     E4M3 codes [N, K] (the checkpoint's own, or per output channel at load, as quant/fp8.py makes
                 them) with a float32 scale per output row and block of inputs (kblock = K, or 128 for
                 128 x 128 block checkpoints); mat2 is the codes' transpose, column-major as cuBLAS wants it.
    activations: quantized to E4M3 as the step runs, per token (scale = the row's amax / 448), or per token
                 and group of 128 inputs for block checkpoints (DeepSeek-V3's recipe).
    y = sum over input blocks b of (xq_b * xs_b) @ (wq_b * ws_b)^T, accumulated in float32: each block's
    xq_b @ wq_b^T by _scaled_mm with unit tensor-wise scales and a float32 output (which torch's CUDA builds
    take on Hopper from 2.5 on; row-wise scales with a float32 output need sm90 and cuBLAS >= 12.9, older
    builds refuse them), then times the row and column scales in float32 (the test file's `gpu` test
    checks this build).

A pre-quantized checkpoint's own activation scheme (quant/activations.py: a static `input_scale`, per
token, per token group) replaces that default (`take_input_quant`); the kernel quantizes with it, so
nothing rounds the input twice. The same arithmetic runs on the CPU through torch's CPU `_scaled_mm`, which is how it is tested
here (tests/quant/test_scaled_mm_fp8.py); on the CPU the registry's `fp8` stays quant/fp8.py (float32
activations, the exact reference)."""
from __future__ import annotations

import torch

from tokenmill.quant.activations import fp8_codes, fp8_static_codes
from tokenmill.quant.fp8 import FP8Method

ALIGN = 16          # cuBLAS FP8 GEMMs want every dimension a multiple of 16


def _activations(x: torch.Tensor, kblock: int, input_quant) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x [M, K] -> (E4M3 codes, float32 scales [M, K / group], group): the checkpoint's scheme where it gives
    one (a static scale: every row and group the same), else per token, or per kblock group for blocks."""
    m, k = x.shape
    if input_quant is None:
        return (*fp8_codes(x, kblock), kblock)
    scheme = input_quant.scheme
    if scheme.granularity == "tensor":
        scale = torch.full((m, 1), input_quant.scale, dtype=torch.float32, device=x.device)
        return fp8_static_codes(x, input_quant.scale), scale, k
    group = scheme.group if scheme.granularity == "group" else k
    return (*fp8_codes(x, group), group)


class FP8ScaledMMMethod(FP8Method):
    """quantization="fp8" on CUDA, and FP8 checkpoints there: FP8Method's codes and scales (from the
    checkpoint or quantized at load), kept on the device, multiplied by torch._scaled_mm."""
    platform = "cuda"

    def check_shape(self, layer) -> None:
        if layer.in_features % ALIGN or layer.out_features % ALIGN:
            raise ValueError(f"fp8 (torch._scaled_mm) needs {layer.prefix or 'a linear layer'}'s dimensions "
                             f"[{layer.out_features}, {layer.in_features}] to be multiples of {ALIGN}")

    @staticmethod
    def _register(layer, q: torch.Tensor, scales: torch.Tensor, kblock: int, device=None) -> None:
        if kblock != q.shape[1] and q.shape[1] % kblock:
            raise ValueError(f"{layer.prefix or 'a linear layer'}: in_features {q.shape[1]} is not a multiple of "
                             f"the checkpoint's {kblock}-input blocks (per-group activations need whole blocks)")
        device = device if device is not None else q.device
        layer.register_buffer("fp8_weight", q.to(device).contiguous(), persistent=False)           # [N, K]
        # [K / kblock, 1, N]: block b's scale of every output row, as _scaled_mm's (1, N) scale_b
        layer.register_buffer("fp8_scale", scales.t().float().unsqueeze(1).contiguous().to(device), persistent=False)
        # _scaled_mm's unit tensor-wise scales, made here: not at a step's first call, which may be a CUDA
        # graph's capture
        layer.register_buffer("fp8_unit_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        layer.fp8_kblock = kblock

    def take_input_quant(self, layer, input_quant) -> None:
        """The checkpoint's FP8 activation scheme, applied by this kernel's own quantization (`apply`)."""
        if input_quant.scheme.format != "fp8":
            raise ValueError(f"{layer.prefix or 'a linear layer'}: FP8 weights with {input_quant.scheme.describe()} "
                             "are not supported")
        k, g = layer.in_features, input_quant.scheme.group or layer.in_features
        if k % g or (max(g, layer.fp8_kblock) % min(g, layer.fp8_kblock)):
            raise ValueError(f"{layer.prefix or 'a linear layer'}: activation groups of {g} inputs do not nest with "
                             f"the weight's {layer.fp8_kblock}-input blocks")
        layer.fp8_input = input_quant

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if x2.is_cuda and m % ALIGN:                      # pad the rows; the padding's outputs are dropped
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, ALIGN - m % ALIGN))
        kblock = layer.fp8_kblock
        xq, xs, group = _activations(x2, kblock, getattr(layer, "fp8_input", None))
        step = min(group, kblock)                         # inputs per GEMM: both scales constant over them
        one = getattr(layer, "fp8_unit_scale", None)
        if one is None or one.device != xq.device:
            one = torch.ones((), dtype=torch.float32, device=xq.device)
        y = None
        for b in range(k // step):                        # one GEMM per input block (one for row scales)
            cols, a, w = slice(b * step, (b + 1) * step), b * step // group, b * step // kblock
            part = torch._scaled_mm(xq[:, cols], layer.fp8_weight[:, cols].t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.float32)                       # the codes' products, summed
            part.mul_(xs[:, a:a + 1]).mul_(layer.fp8_scale[w])                     # [M, 1] rows, [1, N] columns
            y = part if y is None else y.add_(part)
        y = y[:m].to(x.dtype).reshape(*lead, -1)            # summed in float32, given back in x's dtype
        return self.add_bias(layer, y)
