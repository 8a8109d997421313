"""Weight-only int8 and int4 linear layers for CUDA, as Triton kernels that dequantize a tile of the
weight in registers and multiply it with tl.dot (float32 accumulation): the weight crosses the memory
bus at 1 or 0.5 bytes per value, which is what bounds a decode step. Also runnable on the CPU under
TRITON_INTERPRET=1 (how tests check them against a dequantized matmul).

Both formats keep GGUF's group of 32 inputs, so GGUF weights load without a float round trip:
    int8  w[n, k] = q[n, k] * d[n, g]            (Q8_0: q int8, d per 32 inputs)
    int4  w[n, k] = q[n, k] * d[n, g] + m[n, g]  (Q4_1: q 0..15; the CPU int4's (q - 8)*scale + zero maps
                                                  with d = scale, m = zero - 8 * scale)
Packed layouts, K-major so a program's loads along N are contiguous:
    int8  qweight [K, N] int8
    int4  qweight [K/2, N] uint8: within group g, byte 16g + j holds input 32g + j in its low nibble and
          input 32g + 16 + j in its high nibble (Q4_1's order)
    scales d, m [K/32, N] float32
"""
from __future__ import annotations

import torch

from tokenmill.quant.base import QuantMethod

GROUP = 32
BLOCK_N = 64


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def int8_matmul(x_ptr, w_ptr, d_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, 32)
        mmask, nmask = rm < M, rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for g in range(0, K // 32):
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (g * 32 + j)[None, :], mask=mmask[:, None], other=0.0)
            q = tl.load(w_ptr + (g * 32 + j)[:, None] * N + rn[None, :], mask=nmask[None, :], other=0)
            d = tl.load(d_ptr + g * N + rn, mask=nmask, other=0.0)
            w = (q.to(tl.float32) * d[None, :]).to(x.dtype)                            # [32, BLOCK_N]
            acc += tl.dot(x, w, input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def int4_matmul(x_ptr, w_ptr, d_ptr, m_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
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
            d = tl.load(d_ptr + g * N + rn, mask=nmask, other=0.0)[None, :]
            m = tl.load(m_ptr + g * N + rn, mask=nmask, other=0.0)[None, :]
            w_lo = ((b & 0xF).to(tl.float32) * d + m).to(lo.dtype)                     # [16, BLOCK_N]
            w_hi = ((b >> 4).to(tl.float32) * d + m).to(lo.dtype)
            acc += tl.dot(lo, w_lo, input_precision=PRECISION)
            acc += tl.dot(hi, w_hi, input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    return triton, int8_matmul, int4_matmul


_COMPILED = None


def kernels():
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = _kernels()
    return _COMPILED


def _launch(kernel, x: torch.Tensor, weights: tuple, n: int) -> torch.Tensor:
    """x [T, K] -> [T, N] in x's dtype."""
    triton = kernels()[0]
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"      # tf32 is ignored below float32
    kernel[grid](x, *weights, y, m, n, k, x.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=BLOCK_N,
                 PRECISION=precision)
    return y


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [T, K]; qweight [K, N] int8; d [K/32, N] float32 -> x @ (q * d) [T, N]."""
    return _launch(kernels()[1], x, (qweight, d), qweight.shape[1])


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [T, K]; qweight [K/2, N] uint8 (module docstring); d, m [K/32, N] float32 -> x @ (q * d + m)."""
    return _launch(kernels()[2], x, (qweight, d, m), qweight.shape[1])


def quantize_int8_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, d [N, K/32] float32): symmetric, absmax / 127 per 32 inputs."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    d = groups.abs().amax(dim=2) / 127
    q = torch.round(groups / d.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(2)).clamp_(-127, 127)
    return q.to(torch.int8).view(n, k), d


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> [K/2, N] uint8 in the kernel's nibble order."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // GROUP, 2, 16)              # [N, groups, low|high half, 16]
    packed = g[:, :, 0, :] | (g[:, :, 1, :] << 4)                  # [N, groups, 16]
    return packed.reshape(n, k // 2).t().contiguous()


class _TritonWeightOnly(QuantMethod):
    platform = "cuda"
    lm_head_method = None

    def check_shape(self, layer) -> None:
        if layer.in_features % GROUP:
            raise ValueError(f"{self.name} quantization of {layer.prefix or 'a linear layer'} "
                             f"[{layer.out_features}, {layer.in_features}] needs in_features a multiple of {GROUP}")

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "qweight", None) is None:                  # not already filled from GGUF blocks
            self.pack_float(layer, layer.weight.data)
        self.drop_float_weight(layer)


class Int8TritonMethod(_TritonWeightOnly):
    name = "int8"
    direct_gguf_types = ("Q8_0",)

    def pack_float(self, layer, w: torch.Tensor) -> None:
        self.set_packed(layer, *quantize_int8_groups(w))

    def set_packed(self, layer, q: torch.Tensor, d: torch.Tensor) -> None:
        """q [N, K] int8, d [N, K/32] float32, on any device: moved to the layer's."""
        device = layer.weight.device                  # still there: the float weight goes after packing
        layer.register_buffer("qweight", q.t().contiguous().to(device), persistent=False)      # [K, N]
        layer.register_buffer("scales", d.t().contiguous().float().to(device), persistent=False)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(layer, int8_matmul(x, layer.qweight, layer.scales))


class Int4TritonMethod(_TritonWeightOnly):
    name = "int4"
    direct_gguf_types = ("Q4_1",)
    lm_head_method = "int8"   # as on the CPU: the head is the layer most sensitive to weight error

    def pack_float(self, layer, w: torch.Tensor) -> None:
        from tokenmill.quant.int4 import quantize_groupwise_int4
        self.set_packed(layer, *quantize_groupwise_int4(w.float()))

    def set_packed(self, layer, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """q [N, K] 0..15, scale, zero [N, K/32] float32 in the CPU int4's convention ((q - 8)*scale + zero)."""
        device = layer.weight.device                  # still there: the float weight goes after packing
        layer.register_buffer("qweight", pack_int4(q).to(device), persistent=False)             # [K/2, N]
        layer.register_buffer("scales", scale.t().contiguous().float().to(device), persistent=False)
        layer.register_buffer("mins", (zero - 8.0 * scale).t().contiguous().float().to(device), persistent=False)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(layer, int4_matmul(x, layer.qweight, layer.scales, layer.mins))
