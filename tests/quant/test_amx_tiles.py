"""Steps of many rows through the int4 / int8 tiles on AMX (csrc/amx_tiles.cpp, inside gemv_q4 / gemv_q8):
from amx_min_rows() rows the result is the bfloat16 product of the weights the tiles hold (each weight and
activation rounded to bfloat16 once, float32 sums), below it the VNNI kernels' result; both paths agree
within their roundings, and the threshold is settable (0: never) and refused when negative."""
from __future__ import annotations

import pytest
import torch

from tests.quant.test_tile_widen import q4_weight, q8_weight
from tokenmill.quant import tile_kernels

native = tile_kernels.kernels()
amx = native is not None and hasattr(native, "set_amx_min_rows") and native.amx_tiles_take(native.amx_min_rows())
needs_amx = pytest.mark.skipif(not amx, reason="the AMX path needs an AMX-BF16 build and CPU")

SHAPES = [(40, 64), (96, 576), (200, 1536)]         # N % 16 != 0 (the last block's columns) and K of 2-48 groups


@pytest.fixture
def min_rows():
    """Restores the process's threshold after a test that changes it."""
    saved = native.amx_min_rows()
    yield saved
    native.set_amx_min_rows(saved)


def weight(kind: str, n: int, k: int):
    """-> (tiles, [scales,] w [N, K] float32 as the tiles mean it)."""
    return q4_weight(n, k, n + k) if kind == "q4" else q8_weight(n, k, n + k)


def run(kind: str, x: torch.Tensor, weight) -> torch.Tensor:
    n = weight[-1].size(0)
    return native.gemv_q4(x, weight[0], n) if kind == "q4" else native.gemv_q8(x, weight[0], weight[1], n)


def rows(m: int, k: int) -> torch.Tensor:
    """x [m, k] with strided rows (a slice of a wider tensor), as a step's hidden states may be."""
    return torch.randn(m + 2, k + 32, generator=torch.Generator().manual_seed(m))[1:m + 1, 16:16 + k]


@needs_amx
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("m", [32, 33, 47, 64, 100])
@pytest.mark.parametrize("n,k", SHAPES)
def test_steps_from_the_threshold_are_the_bfloat16_product(kind, m, n, k, min_rows):
    native.set_amx_min_rows(32)
    w = weight(kind, n, k)
    ref = rows(m, k).bfloat16().float() @ w[-1].bfloat16().float().t()
    got = run(kind, rows(m, k), w)
    assert got.shape == (m, n) and got.is_contiguous()
    # same products, float32 sums in another order: a few float32 ulps of the sum of |terms|
    bound = rows(m, k).bfloat16().float().abs() @ w[-1].bfloat16().float().abs().t()
    assert ((got - ref).abs() <= 1e-5 * bound + 1e-30).all()


@needs_amx
@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_smaller_steps_and_a_zero_threshold_keep_the_vnni_kernels(kind, min_rows):
    n, k = SHAPES[1]
    w = weight(kind, n, k)
    native.set_amx_min_rows(0)
    vnni_small, vnni_large = run(kind, rows(31, k), w), run(kind, rows(40, k), w)
    native.set_amx_min_rows(32)
    assert torch.equal(run(kind, rows(31, k), w), vnni_small)       # below the threshold: the same kernel
    on_amx = run(kind, rows(40, k), w)
    assert not torch.equal(on_amx, vnni_large)                        # int8 activations vs bfloat16 ones
    # both within their roundings of the float32 product (VNNI: int8 activations per group of 32)
    exact = rows(40, k) @ w[-1].t()
    scale = exact.abs().max()
    assert (on_amx - exact).abs().max() <= 0.01 * scale and (vnni_large - exact).abs().max() <= 0.02 * scale


@needs_amx
def test_a_negative_threshold_is_refused_by_name(min_rows):
    with pytest.raises(RuntimeError, match="rows must be >= 0"):
        native.set_amx_min_rows(-1)
    assert native.amx_min_rows() == min_rows


def test_the_environment_threshold_is_checked(monkeypatch):
    class Fake:
        rows = None

        def set_amx_min_rows(self, rows):
            self.rows = rows
    monkeypatch.setenv(tile_kernels.AMX_MIN_ROWS_ENV, "48")
    fake = Fake()
    tile_kernels._configure_amx.__wrapped__(fake)
    assert fake.rows == 48
    for bad in ("-1", "many"):
        monkeypatch.setenv(tile_kernels.AMX_MIN_ROWS_ENV, bad)
        with pytest.raises(ValueError, match="TOKENMILL_AMX_MIN_ROWS must be an integer >= 0"):
            tile_kernels._configure_amx.__wrapped__(Fake())


@needs_amx
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_prompt_chunks_stay_on_the_amx_tiles_up_to_the_larger_threshold(method, min_rows):
    """Where the AMX tiles take a step of prefill_min_rows rows, a layer runs prompt chunks through the bfloat16
    GEMM only from amx_prefill_min_rows; with the AMX path off, from prefill_min_rows as before."""
    from tests.quant.test_tile_widen import quantized_linear
    from tokenmill.layers.linear import PrefillRows, step_prefill_rows
    from tokenmill.quant.base import QuantMethod
    native.set_amx_min_rows(32)
    layer = quantized_linear(method)
    assert layer.prefill_fn is not None and layer.prefill_min_rows == QuantMethod.amx_prefill_min_rows > 128
    x = torch.randn(200, 128, generator=torch.Generator().manual_seed(7))
    with step_prefill_rows(PrefillRows.of(200, list(range(8, 200)))):       # 192 prompt rows beside 8 decode
        assert torch.equal(layer(x), layer.tile_fn(x))                      # one tile call, on AMX
    native.set_amx_min_rows(0)
    assert quantized_linear(method).prefill_min_rows == QuantMethod.prefill_min_rows == 128
