"""csrc/fp8_gemv.cpp: FP8's fast-mode kernel for steps of a few rows (AVX-512 BF16 + VBMI builds). The codes
are widened to bfloat16 exactly, x is rounded to bfloat16, the products are summed in float32 and each block's
sum is scaled in float32: so the output equals x.bfloat16() @ the dequantized weight^T up to float32 summation.
Skipped where the build lacks the kernel (the exact grouped GEMM runs instead, tests/quant/test_fp8.py)."""
from __future__ import annotations

import pytest
import torch

from tokenmill.quant import fp8
from tokenmill.quant.fp8 import E4M3_MAX


@pytest.fixture(scope="module")
def gemv():
    from tokenmill.quant import tile_kernels
    kernel = getattr(tile_kernels.kernels() or object(), "fp8_gemv_bf16", None)
    if kernel is None:
        pytest.skip("needs an AVX-512 BF16 + VBMI build of the native kernels")
    return kernel


def _finite_codes() -> torch.Tensor:
    """Every E4M3 code but the two NaNs (0x7F, 0xFF), as float8_e4m3fn."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[codes & 0x7F != 0x7F].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("column", [0, 5, 37, 63, 64, 100])
def test_every_code_is_decoded_exactly_at_every_position_of_a_chunk(gemv, column):
    """Column `column` of a weight [254, 104] holds every finite code, the rest 0; x one-hot there: y is the
    codes' values bitwise (positions in the table-lookup chunks of 64, whose order x follows, and in the tail)."""
    codes = _finite_codes()
    w = torch.zeros(len(codes), 104, dtype=torch.uint8)
    w[:, column] = codes.view(torch.uint8)
    x = torch.zeros(1, 104)
    x[0, column] = 1.0
    y = gemv(x, w.view(torch.float8_e4m3fn), torch.ones(len(codes), 1), 0)
    assert torch.equal(y[0], codes.float())


def _case(n: int, k: int, kblock: int, rows: int, seed: int):
    """Codes of a weight spanning many binades (subnormal codes included), scales per (row, block), x."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-6, 1, k)
    scales = torch.stack([w[:, b:b + kblock].abs().amax(1) / E4M3_MAX for b in range(0, k, kblock)], dim=1)
    codes = fp8.quantize_with(w, scales, kblock)
    x = torch.randn(rows, k, generator=g) * 3
    return codes, scales.contiguous(), x


@pytest.mark.parametrize("k,kblock", [(576, 576), (200, 200), (264, 264), (392, 128), (640, 128), (192, 64)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 33])
def test_the_kernel_is_the_bfloat16_rounded_x_times_the_exact_weight(gemv, k, kblock, rows):
    """Every row count of a pass (1-16: tiles of 4, 2 and 1 weight rows) and several passes, N off the tiles
    (45 rows), K off the chunks of 64 (a last chunk of 8..56), per-row and block scales: within float32
    summation error of x.bfloat16() @ dequantized^T in float64, and not the unrounded x's product."""
    codes, scales, x = _case(45, k, kblock, rows, seed=k * 100 + rows)
    dequantized = fp8.dequantize(codes, scales, kblock).double()
    y = gemv(x, codes, scales, kblock if kblock != k else 0)
    rounded = x.bfloat16().double() @ dequantized.t()
    assert y.shape == (rows, 45) and y.dtype == torch.float32
    assert ((y.double() - rounded).abs() <= 1e-5 * (x.abs().double() @ dequantized.abs().t()) + 1e-30).all()
    exact = x.double() @ dequantized.t()
    assert ((y.double() - exact).norm() / exact.norm()).item() > 1e-5      # x was rounded: not the exact product


def test_a_strided_x_and_empty_shapes(gemv):
    codes, scales, x = _case(20, 128, 128, 6, seed=1)
    wide = torch.zeros(6, 256)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    torch.testing.assert_close(gemv(strided, codes, scales, 0), gemv(x, codes, scales, 0), rtol=0, atol=0)
    assert gemv(x[:0], codes, scales, 0).shape == (0, 20)


@pytest.mark.parametrize("case,message", [
    ("int8 codes", "codes must be contiguous float8_e4m3fn"),
    ("K not a multiple of 8", "K a multiple of 8"),
    ("kblock 48", "kblock must be K \\(192\\) or a multiple of 64, got 48"),
    ("scales of another shape", "scales must be contiguous float32 \\[N, K / kblock\\] = \\[4, 3\\]"),
    ("float64 x", "x must be float32 \\[T, 192\\]"),
    ("x of another width", "x must be float32 \\[T, 192\\]"),
])
def test_bad_arguments_are_named(gemv, case, message):
    codes, scales, x = _case(4, 192, 64, 2, seed=2)
    kblock = 64
    if case == "int8 codes":
        codes = codes.view(torch.int8)
    elif case == "K not a multiple of 8":
        codes, x, kblock = codes[:, :188].contiguous(), x[:, :188], 0
        scales = scales[:, :1].contiguous()
    elif case == "kblock 48":
        kblock = 48
    elif case == "scales of another shape":
        scales = scales[:, :2].contiguous()
    elif case == "float64 x":
        x = x.double()
    else:
        x = x[:, :128]
    with pytest.raises(RuntimeError, match=message):
        gemv(x, codes, scales, kblock)
