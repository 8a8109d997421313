"""A step's prefill rows through one bfloat16 GEMM (csrc/tile_widen.cpp): the int4 / int8 tiles widened to
exactly the bfloat16 rounding of the weight they hold, the GEMM within bfloat16's rounding of the float32
product, and Linear running only the rows the step marks as prefill rows that way (layers/linear.py
PrefillRows): decode and verify rows give the tile kernel's result, bit for bit."""
from __future__ import annotations

import pytest
import torch

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.layers.linear import Linear, PrefillRows, step_prefill_rows
from tokenmill.quant import get_quant_method, tile_kernels
from tokenmill.quant.int4 import pack_q4_tiles
from tokenmill.quant.int8 import pack_q8_tiles
from tokenmill.quant.unquantized import UnquantizedMethod
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import build_step_inputs

native = tile_kernels.kernels()
widens = native is not None and hasattr(native, "linear_tiles_bf16")
needs_widen = pytest.mark.skipif(not widens, reason="the widening kernels need the tile kernels (AVX-512 VNNI)")
needs_amx = pytest.mark.skipif(not tile_kernels.bf16_gemm_faster(), reason="prefill rows run bfloat16 on AMX only")

SHAPES = [(96, 64), (40, 576), (3072, 128)]                 # N % 16 != 0 included (the last tile's tail)


def q4_weight(n: int, k: int, seed: int):
    """-> (tiles, w [N, K] float32 as the tiles mean it: d q + m, one float32 rounding)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.8).half().float()
    w = q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    return pack_q4_tiles(q, d, m), w


def q8_weight(n: int, k: int, seed: int):
    """-> (tiles, padded scales, w [N, K] float32 = q * scale)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    tiles, padded = pack_q8_tiles(q, scale)
    return tiles, padded, q.float() * scale[:, None]


@needs_widen
@pytest.mark.parametrize("n,k", SHAPES)
def test_widened_weights_are_the_bfloat16_rounding_of_the_tiles(n, k):
    tiles, w = q4_weight(n, k, n + k)
    assert torch.equal(native.q4_tiles_to_bf16(tiles, n), w.to(torch.bfloat16).t())
    tiles, scales, w = q8_weight(n, k, n + k)
    assert torch.equal(native.q8_tiles_to_bf16(tiles, scales, n), w.to(torch.bfloat16).t())


@needs_widen
@pytest.mark.parametrize("m", [1, 7, 130])
@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_is_the_bfloat16_product_within_its_rounding(m, n, k):
    """y = bf16(bf16(x) @ bf16(w)^T) with float32 sums: within 2^-8 of |x_bf16| @ |w_bf16|^T per output
    (the output's rounding, plus float32 sums in any order)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :5] = torch.tensor([1e4, -1e-4, 0.0, 3.0, -7.5])
    q4_tiles, q4_w = q4_weight(n, k, m)
    for kind, (tiles, scales, w) in (("q4", (q4_tiles, None, q4_w)), ("q8", q8_weight(n, k, m))):
        y = native.linear_tiles_bf16(x, kind, tiles, scales, n)
        xb, wb = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
        bound = (xb.abs() @ wb.abs().T) * 2.0 ** -8
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert bool(((y.double() - xb @ wb.T).abs() <= bound + 1e-30).all()), kind


@needs_widen
def test_bad_arguments_are_refused_by_name():
    tiles, _ = q4_weight(32, 64, 0)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="kind must be q4 or q8"):
        native.linear_tiles_bf16(x, "q5", tiles, None, 32)
    with pytest.raises(RuntimeError, match="q8 tiles need their scale"):
        native.linear_tiles_bf16(x, "q8", tiles, None, 32)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        native.linear_tiles_bf16(torch.randn(3, 32), "q4", tiles, None, 32)
    with pytest.raises(RuntimeError, match="does not fit 2 row blocks"):
        native.linear_tiles_bf16(x, "q4", tiles, None, 48)
    with pytest.raises(RuntimeError, match="q must be contiguous"):
        native.q4_tiles_to_bf16(tiles[..., :288].contiguous(), 32)
    q8_tiles, scales, _ = q8_weight(32, 64, 0)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32 \\[32\\]"):
        native.q8_tiles_to_bf16(q8_tiles, scales[:16].clone(), 32)


def quantized_linear(method: str, n: int = 96, k: int = 128) -> Linear:
    layer = Linear(k, n, bias=True)
    g = torch.Generator().manual_seed(3)
    layer.weight.data.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.set_quant_method(UnquantizedMethod() if method == "fp32" else get_quant_method(method))
    return layer


@needs_amx
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_prefill_rows_take_the_bfloat16_gemm_and_the_others_stay_on_the_tiles(method):
    layer = quantized_linear(method)
    layer.prefill_min_rows = 3
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4))
    prefill = [1, 2, 3, 6]
    decode = [0, 4, 5, 7, 8]
    with step_prefill_rows(PrefillRows.of(9, prefill)):
        y = layer(x)
    assert torch.equal(y[decode], layer.tile_fn(x[decode]))            # bit for bit: the tile kernel's rows
    assert torch.equal(y[prefill], layer.prefill_fn(x[prefill]))
    assert not torch.equal(y[prefill], layer.tile_fn(x[prefill]))       # another kernel did run them
    for i in decode:                                                    # whatever shares the step
        assert (y[i] - layer(x[i:i + 1].clone())[0]).abs().max() < 1e-5


@needs_amx
def test_the_tiles_run_below_the_threshold_and_for_the_last_layers_kept_rows():
    layer = quantized_linear("int4")
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(5))
    layer.prefill_min_rows = 5
    with step_prefill_rows(PrefillRows.of(9, [0, 1, 2, 3])):            # 4 prefill rows < 5
        assert torch.equal(layer(x), layer.tile_fn(x))
    with step_prefill_rows(PrefillRows.of(12, list(range(12)))):        # the layer sees 9 of the step's 12 rows
        assert torch.equal(layer(x), layer.tile_fn(x))
    with step_prefill_rows(PrefillRows.of(9, list(range(9)))):          # all 9: one GEMM, no split
        assert torch.equal(layer(x), layer.prefill_fn(x))
    assert torch.equal(layer(x), layer.tile_fn(x))                      # outside a step: tiles


def test_float_layers_have_no_prefill_kernel():
    layer = quantized_linear("fp32")
    assert layer.prefill_fn is None
    with step_prefill_rows(PrefillRows.of(4, [0, 1, 2, 3])):
        layer.prefill_min_rows = 1
        x = torch.randn(4, 128)
        torch.testing.assert_close(layer(x), layer.quant_method.apply(layer, x))


def test_prefill_rows_of_a_step_are_its_prompt_chunks():
    """Rows of prompt chunks (any length > 1, no drafts) are prefill rows; a decode row and a verify step's
    1 + d rows are not."""
    def scheduled(rid, n, start, drafts=0):
        return ScheduledRequest(rid, [1] * n, start, [0, 1, 2, 3], True, SamplingParams(), [], [], [],
                                num_draft_tokens=drafts)
    step = SchedulerOutput([scheduled("decode", 1, 9), scheduled("chunk", 5, 0), scheduled("verify", 3, 4, 2),
                            scheduled("tail", 2, 8)])
    rows = build_step_inputs(step, 4).prefill_rows
    assert rows.step_rows == 11 and rows.index.tolist() == [1, 2, 3, 4, 5, 9, 10]
    assert rows.others.tolist() == [0, 6, 7, 8] and rows.count == 7
    assert build_step_inputs(SchedulerOutput([scheduled("a", 1, 3), scheduled("v", 2, 3, 1)]), 4).prefill_rows is None
    every = build_step_inputs(SchedulerOutput([scheduled("p", 4, 0), scheduled("q", 2, 0)]), 4).prefill_rows
    assert every.index is None and every.count == 6
