"""NVFP4 and MXFP4 weight-only linear layers for CUDA GPUs without FP4 tensor cores (Hopper: H100, H200): a
Triton kernel decodes a tile of E2M1 codes in registers, multiplies by its block scales and feeds tl.dot
(float32 accumulation), so the weight crosses the memory bus at half a byte a value. Runs on the CPU under
TRITON_INTERPRET=1, how the tests check it against quant/fp4.py's dequantized matmul.

Layout (K-major, like triton_weight_only.py's int4, so loads along N are contiguous):
    qweight [K/2, N] uint8: within each run g of 32 inputs, byte 16g + j holds input 32g + j in its low nibble
            and input 32g + 16 + j in its high nibble (each half one NVFP4 block; both halves one MXFP4 block)
    scales  [K/block, N] float32 (NVFP4: E4M3 block scale x tensor scale; MXFP4: 2^(e - 127))
Codes: bit 3 the sign, bits 2..1 the exponent e, bit 0 the mantissa m: e = 0 -> m / 2, else 2^(e-1) (1 + m / 2).
"""
from __future__ import annotations

import torch

from tokenmill.quant import fp4
from tokenmill.quant.base import QuantMethod
from tokenmill.quant.triton_weight_only import BLOCK_N, kernels as weight_only_kernels, pack_int4

_COMPILED = None


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp4_matmul(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym, HALVES_PER_BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, 16)
        mmask, nmask = rm < M, rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for g in range(0, K // 32):
            lo = tl.load(x_ptr + rm[:, None] * stride_xm + (g * 32 + j)[None, :], mask=mmask[:, None], other=0.0)
            hi = tl.load(x_ptr + rm[:, None] * stride_xm + (g * 32 + 16 + j)[None, :], mask=mmask[:, None],
                         other=0.0)
            b = tl.load(w_ptr + (g * 16 + j)[:, None] * N + rn[None, :], mask=nmask[None, :], other=0)
            s_lo = tl.load(s_ptr + (2 * g // HALVES_PER_BLOCK) * N + rn, mask=nmask, other=0.0)[None, :]
            s_hi = tl.load(s_ptr + ((2 * g + 1) // HALVES_PER_BLOCK) * N + rn, mask=nmask, other=0.0)[None, :]
            for half in tl.static_range(2):                  # low nibbles: inputs 0..15 of the run; high: 16..31
                c = ((b >> (4 * half)) & 0xF).to(tl.int32)
                e, m = (c >> 1) & 3, c & 1
                normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)    # 2^(e-1) (1 + m/2)
                mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
                w = tl.where((c & 8) != 0, -mag, mag) * (s_hi if half else s_lo)       # [16, BLOCK_N]
                acc += tl.dot(hi if half else lo, w.to(lo.dtype), input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    return fp4_matmul


def fp4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, K]; qweight [K/2, N] uint8; scales [K/block, N] float32 (block 16 or 32) -> [T, N] in x's dtype."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = _kernel()
    triton = weight_only_kernels()[0]
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _COMPILED[grid](x, qweight, scales, y, m, n, k, x.stride(0), y.stride(0), HALVES_PER_BLOCK=block // 16,
                    BLOCK_M=block_m, BLOCK_N=BLOCK_N, PRECISION=precision)
    return y


class _TritonFP4(QuantMethod):
    platform = "cuda"
    lm_head_method = "int8"
    cpu_method: type = fp4.FP4Method        # the same format's scales on the CPU

    def check_shape(self, layer) -> None:
        if layer.in_features % 32:
            raise ValueError(f"{self.name} quantization of {layer.prefix or 'a linear layer'} "
                             f"[{layer.out_features}, {layer.in_features}] needs in_features a multiple of 32")

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "qweight", None) is None:             # not already given the checkpoint's codes
            w = layer.weight.data.float()
            cpu = self.cpu_method()
            scales = cpu.checkpoint_scales(layer)[0] if getattr(layer, "checkpoint_fp4", None) else cpu.block_scales(w)
            self._register(layer, fp4.quantize(w, scales.to(w.device), cpu.block), scales, w.device)
        self.drop_float_weight(layer)

    def set_codes(self, layer, codes: list, device: torch.device) -> None:
        """The checkpoint's own codes (no float copy), with the scales of `checkpoint_fp4`."""
        self._register(layer, fp4.assemble_codes(layer, codes, self.name),
                       self.cpu_method().checkpoint_scales(layer)[0], device)

    @staticmethod
    def _register(layer, packed: torch.Tensor, scales: torch.Tensor, device: torch.device) -> None:
        """packed [N, K/2] (the checkpoints' byte order), scales [N, K/block] -> the kernel's layouts."""
        codes = fp4.unpack(packed)                                                                # [N, K] 0..15
        layer.register_buffer("qweight", pack_int4(codes).to(device), persistent=False)          # [K/2, N]
        layer.register_buffer("scales", scales.float().t().contiguous().to(device), persistent=False)  # [K/block, N]

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(layer, fp4_matmul(x, layer.qweight, layer.scales, self.cpu_method.block))


class NVFP4TritonMethod(_TritonFP4):
    name = "nvfp4"
    cpu_method = fp4.NVFP4Method


class MXFP4TritonMethod(_TritonFP4):
    name = "mxfp4"
    cpu_method = fp4.MXFP4Method
