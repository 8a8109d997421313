"""csrc/fp8_gemv.cpp: FP8's fast-mode kernels for steps of a few rows.
- fp8_gemv_bf16 (AVX-512 BF16 + VBMI builds): the codes widened to bfloat16 exactly, x rounded to bfloat16, the
  products summed in float32 and each block's sum scaled in float32: the output equals x.bfloat16() @ the
  dequantized weight^T up to float32 summation.
- fp8_gemv_f16 (AVX-512 FP16 builds): the codes widened to fp16 exactly (value x 2^-8), each row of x scaled by
  a power of two and rounded to fp16, at most 8 products a lane summed by fp16 FMAs before float32: within
  9 x 2^-11 of |x| @ |dequantized|^T of the exact product, elementwise.
Each is skipped where the build lacks it (the exact grouped GEMM runs instead, tests/quant/test_fp8.py)."""
from __future__ import annotations

import math

import pytest
import torch

from tokenmill.quant import fp8
from tokenmill.quant.fp8 import E4M3_MAX

KERNELS = ["fp8_gemv_bf16", "fp8_gemv_f16"]
F16_BOUND = 9 * 2.0 ** -11           # fp8_gemv_f16's error, relative to |x| @ |dequantized|^T (fp8_gemv.h)


def _kernel(name: str):
    from tokenmill.quant import tile_kernels
    kernel = getattr(tile_kernels.kernels() or object(), name, None)
    if kernel is None:
        pytest.skip(f"needs a build of the native kernels with {name} "
                    f"({'AVX-512 FP16' if name.endswith('f16') else 'AVX-512 BF16 + VBMI'})")
    return kernel


@pytest.fixture(scope="module", params=KERNELS)
def gemv(request):
    return _kernel(request.param)


@pytest.fixture(scope="module")
def bf16_gemv():
    return _kernel("fp8_gemv_bf16")


@pytest.fixture(scope="module")
def f16_gemv():
    return _kernel("fp8_gemv_f16")


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


@pytest.mark.parametrize("k,kblock", [(576, 576), (200, 200), (264, 264), (392, 128), (640, 128), (192, 64),
                                     (576, 32), (200, 32), (104, 32), (72, 32), (1536, 16), (72, 16), (200, 16)])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 33])
def test_the_kernel_is_the_bfloat16_rounded_x_times_the_exact_weight(bf16_gemv, k, kblock, rows):
    """Every row count of a pass (1-16) and several passes, N off the tiles (45 rows), K off the chunks of 64
    (a last chunk of 8..56), per-row, block and group scales (groups of 32 or 16: two or four scales within a
    chunk, the last chunk's later groups absent): within float32 summation error of x.bfloat16() @
    dequantized^T in float64, and not the unrounded x's product."""
    codes, scales, x = _case(45, k, kblock, rows, seed=k * 100 + rows)
    dequantized = fp8.dequantize(codes, scales, kblock).double()
    y = bf16_gemv(x, codes, scales, kblock if kblock != k else 0)
    rounded = x.bfloat16().double() @ dequantized.t()
    assert y.shape == (rows, 45) and y.dtype == torch.float32
    assert ((y.double() - rounded).abs() <= 1e-5 * (x.abs().double() @ dequantized.abs().t()) + 1e-30).all()
    exact = x.double() @ dequantized.t()
    assert ((y.double() - exact).norm() / exact.norm()).item() > 1e-5      # x was rounded: not the exact product


@pytest.mark.parametrize("k,kblock", [(576, 576), (200, 200), (264, 264), (392, 128), (640, 128), (192, 64),
                                     (1536, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17])
def test_the_f16_kernel_is_within_its_bound_of_the_exact_product(f16_gemv, k, kblock, rows):
    """Every row count of a pass (1-8: tiles of 4, 2 and 1 weight rows) and several passes, N off the tiles,
    K off the chunks and off the fp16 sums' 4 chunks (K 1536: 6 sums a row), per-row and block scales: each
    output within F16_BOUND x |x| @ |dequantized|^T of the float64 product, about a quarter of the bfloat16
    kernel's error in norm, and not exact (x was rounded)."""
    codes, scales, x = _case(45, k, kblock, rows, seed=k * 100 + rows + 7)
    dequantized = fp8.dequantize(codes, scales, kblock).double()
    y = f16_gemv(x, codes, scales, kblock if kblock != k else 0).double()
    exact = x.double() @ dequantized.t()
    assert ((y - exact).abs() <= F16_BOUND * (x.abs().double() @ dequantized.abs().t()) + 1e-30).all()
    error = ((y - exact).norm() / exact.norm()).item()
    assert 1e-6 < error < 1e-3
    bf16 = x.bfloat16().double() @ dequantized.t()
    assert error < 0.5 * ((bf16 - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e-3, 1.0, 1e4, 1e30, 1e38])
def test_the_f16_kernel_scales_each_row_of_x_into_fp16s_range(f16_gemv, magnitude):
    """Rows of x from 1e-38 (float32 subnormals) to 1e38 (near float32's largest), one beside a row of 1s and
    a zero row: each row's power-of-two scale keeps it within the bound (no fp16 overflow or underflow; the
    weights scaled down where the product would pass float32's range), the zero row gives zeros; a row of a
    power of two times 1.5 against all-448 codes (fp16 sums of 21,504, near their worst case) gives the product
    exactly."""
    codes, scales, _ = _case(24, 576, 576, 1, seed=3)
    scales = scales / max(1.0, magnitude / 1e30)
    g = torch.Generator().manual_seed(4)
    x = torch.stack([torch.randn(576, generator=g).clamp(-3, 3) * magnitude, torch.ones(576), torch.zeros(576)])
    dequantized = fp8.dequantize(codes, scales, 576).double()
    y = f16_gemv(x, codes, scales, 0).double()
    exact = x.double() @ dequantized.t()
    bound = F16_BOUND * (x.abs().double() @ dequantized.abs().t())
    assert torch.isfinite(y).all() and ((y - exact).abs() <= bound + 1e-45).all()
    assert (y[2] == 0).all()
    value = 1.5 * 2.0 ** math.floor(math.log2(magnitude / 1.5))     # 1536 once scaled: exact products and sums
    top = torch.full((8, 576), E4M3_MAX).to(torch.float8_e4m3fn)
    y = f16_gemv(torch.full((1, 576), value), top, torch.ones(8, 1), 0)
    assert torch.equal(y, torch.full((1, 8), 576 * E4M3_MAX) * value)      # inf past float32's range, as float32


def test_the_f16_kernel_propagates_inf_and_nan_in_x(f16_gemv):
    codes, scales, x = _case(8, 128, 128, 3, seed=5)
    x[0, 3], x[1, 7] = float("inf"), float("nan")
    y = f16_gemv(x, codes, scales, 0)
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_a_strided_x_and_empty_shapes(gemv):
    codes, scales, x = _case(20, 128, 128, 6, seed=1)
    wide = torch.zeros(6, 256)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    torch.testing.assert_close(gemv(strided, codes, scales, 0), gemv(x, codes, scales, 0), rtol=0, atol=0)
    assert gemv(x[:0], codes, scales, 0).shape == (0, 20)


def test_the_f16_kernel_refuses_groups_within_a_chunk(f16_gemv):
    """fp8_gemv_f16 sums fp16 products over 4 chunks before scaling: groups of 16 or 32 inputs are refused by
    name (quant/fp8.py's FP8Method runs fp8_gemv_bf16 for such layers)."""
    codes, scales, x = _case(4, 192, 32, 2, seed=2)
    with pytest.raises(RuntimeError, match="kblock must be K \\(192\\) or a multiple of 64, got 32"):
        f16_gemv(x, codes, scales, 32)


@pytest.mark.parametrize("case,message", [
    ("int8 codes", "codes must be contiguous float8_e4m3fn"),
    ("K not a multiple of 8", "K a multiple of 8"),
    ("kblock 48", "kblock must be K \\(192\\) or a multiple of 64.*, got 48"),
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
