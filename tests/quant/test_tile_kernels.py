"""The native tile kernels (csrc/gemv_kernels.cpp) against float64 references of what they compute: the
dequantized weight times activations quantized to int8 per group of 32; their tile layouts; their use by
Linear (float32 up to FLOAT32_MAX_ROWS rows, int8/int4 at every step size)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.layers.linear import Linear
from tokenmill.quant import fp4, get_quant_method, tile_kernels
from tokenmill.quant.int4 import pack_q4_tiles, quantize_groupwise_int4
from tokenmill.quant.int8 import pack_q8_tiles, quantize_per_channel_int8
from tokenmill.quant.unquantized import pack_f32_tiles

native = tile_kernels.kernels()
pytestmark = pytest.mark.skipif(native is None, reason="tile kernels need AVX-512 VNNI and a compiler")

SHAPES = [(96, 64), (100, 576), (36, 1536), (2048, 128), (20, 96)]      # N % 16 != 0, K % 64 != 0 included


@pytest.fixture(autouse=True)
def vnni_at_every_size():
    """These tests check the VNNI kernels' int8 arithmetic: steps of every size run them here (where the AMX
    path exists it would take the larger steps; tests/quant/test_amx_tiles.py checks that one)."""
    if native is None or not hasattr(native, "set_amx_min_rows"):
        yield
        return
    saved = native.amx_min_rows()
    native.set_amx_min_rows(0)
    yield
    native.set_amx_min_rows(saved)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float64 s[g] * xi, xi = round(x * (1 / s[g])), s = max |x| / 127 per group of 32, in
    float32 as the kernels compute it (so every xi matches, ties to even included)."""
    g = x.float().view(x.shape[0], -1, 32)
    s = g.abs().amax(-1, keepdim=True) / 127
    s[s == 0] = 1
    xi = torch.round(g * (1 / s)).clamp(-127, 127)
    return (xi.double() * s.double()).view_as(x)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 37])
def test_q4_kernel_matches_float64_reference(n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, generator=g).half().float()
    mn = -torch.rand(n, k // 32, generator=g).half().float()
    x = torch.randn(m, k, generator=g)
    w_dq = q.double() * d.double().repeat_interleave(32, 1) + mn.double().repeat_interleave(32, 1)
    ref = quantized_activations(x) @ w_dq.T
    y = native.gemv_q4(x, pack_q4_tiles(q, d, mn), n)
    assert y.shape == (m, n) and rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("n,k", SHAPES + [(50, 75)])           # float32 takes any K
@pytest.mark.parametrize("m", [1, 2, 5, 16, 37])
def test_f32_kernel_matches_float64_reference(n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    y = native.gemv_f32(x, pack_f32_tiles(w), n)
    assert y.shape == (m, n) and rel_err(y, x.double() @ w.double().T) < 1e-6


def test_f32_linear_keeps_only_its_packed_copies_and_matches_f_linear():
    g = torch.Generator().manual_seed(8)
    layer = Linear(96, 40, bias=True)
    layer.weight.data.copy_(torch.randn(40, 96, generator=g))
    layer.bias.data.copy_(torch.randn(40, generator=g))
    w, b = layer.weight.data.clone(), layer.bias.data.clone()
    layer.set_quant_method(get_quant_method("float"))
    assert layer.weight is None and layer.tile_fn is not None    # oneDNN copy + tiles remain
    for rows in (1, tile_kernels.FLOAT32_MAX_ROWS, tile_kernels.FLOAT32_MAX_ROWS + 1):  # tiles, then oneDNN
        x = torch.randn(rows, 96, generator=g)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16, 37])
def test_q8_kernel_matches_float64_reference(n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0                                          # an all-zero group (scale 1, no division by 0)
    ref = quantized_activations(x) @ (q.double() * scale.double()[:, None]).T
    y = native.gemv_q8(x, *pack_q8_tiles(q, scale), n)
    assert y.shape == (m, n) and rel_err(y, ref) < 1e-5


def test_kernels_take_strided_rows_and_reject_wrong_shapes():
    q = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    tiles = pack_q4_tiles(q, torch.ones(32, 4), torch.zeros(32, 4))
    wide = torch.randn(2, 256)
    assert torch.equal(native.gemv_q4(wide[:, :128], tiles, 32), native.gemv_q4(wide[:, :128].clone(), tiles, 32))
    with pytest.raises(RuntimeError, match=r"gemv_q4: x must be float32 \[M, 128\]"):
        native.gemv_q4(torch.randn(2, 64), tiles, 32)
    with pytest.raises(RuntimeError, match="gemv_q4: weight must be contiguous uint8"):
        native.gemv_q4(torch.randn(2, 128), tiles, 48)
    with pytest.raises(RuntimeError, match="gemv_q8: scale must be contiguous float32"):
        native.gemv_q8(torch.randn(1, 128), *pack_q8_tiles(torch.zeros(32, 128, dtype=torch.int8),
                                                           torch.ones(32))[:1], torch.ones(8), 32)


def test_kernels_take_zero_rows():
    """A step may hand a layer no rows: each integer kernel returns [0, N]."""
    w = torch.randn(32, 128)
    x = torch.empty(0, 128)
    assert native.gemv_q4(x, pack_q4_tiles(*quantize_groupwise_int4(w)), 32).shape == (0, 32)
    assert native.gemv_q8(x, *pack_q8_tiles(*quantize_per_channel_int8(w)), 32).shape == (0, 32)
    block_scale, tensor_scale = fp4.nvfp4_scales(w)
    packed = fp4.quantize(w, block_scale.float() * tensor_scale, 16)
    tiles, row_scale = fp4.pack_nvfp4_tiles(packed, block_scale, tensor_scale.expand(32))
    assert native.gemv_nvfp4(x, tiles, row_scale, 32).shape == (0, 32)


def test_q4_tiles_hold_every_nibble_and_float16_scale_once():
    """Unpack the tile layout in numpy and get q, d and m back exactly."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d, m = torch.rand(n, k // 32, generator=g).half(), torch.rand(n, k // 32, generator=g).half()
    tiles = pack_q4_tiles(q, d.float(), m.float()).numpy()                   # [3, 4, 320]
    assert tiles.shape == (3, 4, 320)
    nib = tiles[:, :, :256].reshape(3, 4, 4, 16, 4)                           # block, group, chunk, row, j
    lo, hi = nib & 0x0F, nib >> 4
    full = np.concatenate([lo, hi], axis=-1)                                  # [..., row, 8]: inputs 8c + 0..7
    full = full.transpose(0, 3, 1, 2, 4).reshape(48, k)[:n]
    assert np.array_equal(full, q.numpy())
    scales = tiles[:, :, 256:].copy().view(np.float16).reshape(3, 4, 2, 16)  # block, group, (d, m), row
    assert np.array_equal(scales[:, :, 0].transpose(0, 2, 1).reshape(48, 4)[:n], d.numpy())
    assert np.array_equal(scales[:, :, 1].transpose(0, 2, 1).reshape(48, 4)[:n], m.numpy())
    assert not tiles[2, :, :256].reshape(4, 4, 16, 4)[:, :, 8:].any()        # padding rows are zero


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("bias", [False, True])
def test_int_linear_runs_its_tiles_at_every_step_size_and_keeps_no_other_copy(mode, bias):
    g = torch.Generator().manual_seed(6)
    layer = Linear(576, 208, bias=bias)           # int4: PyTorch's kernel needs N % 16 == 0
    layer.weight.data.copy_(torch.randn(208, 576, generator=g) * 0.05)
    if bias:
        layer.bias.data.copy_(torch.randn(208, generator=g))
    w = layer.weight.data.clone()
    if mode == "int4":
        q, scale, zero = quantize_groupwise_int4(w)
        w_dq = (q.double() - 8) * scale.double().repeat_interleave(32, 1) + zero.double().repeat_interleave(32, 1)
    else:
        q, scale = quantize_per_channel_int8(w)
        w_dq = q.double() * scale.double()[:, None]
    layer.set_quant_method(get_quant_method(mode))
    assert layer.tile_fn is not None
    assert layer.tile_max_rows == tile_kernels.ANY_ROWS
    x = torch.randn(300, 576, generator=g)
    ref = x.double() @ w_dq.T + (layer.bias.double() if bias else 0)
    tiled = layer(x)                                        # native kernel: int8 activations per 32
    assert rel_err(tiled, ref) < 2e-2
    for rows in (1, 17):                                    # rows are independent of each other
        torch.testing.assert_close(layer(x[:rows]), tiled[:rows], rtol=0, atol=0)
    assert getattr(layer, "qweight", None) is None and getattr(layer, "int4_packed", None) is None
    with pytest.raises(RuntimeError, match="only the tile kernel's copy exists"):
        layer.quant_method.apply(layer, x)


def test_gguf_q4_1_scales_reach_the_tiles_exactly():
    """Q4_1's float16 d and m go into the tiles unchanged (m = zero - 8 d is exact for them)."""
    from tokenmill.quant.gguf_direct import q4_1_to_int4
    from tests.quant.test_gguf_direct import random_q4_1
    n, k = 48, 128
    raw = random_q4_1(n, k)
    q, d, zero = q4_1_to_int4(raw, (n, k))
    blocks = torch.from_numpy(raw).view(n, k // 32, 20)
    d16 = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    m16 = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    tiles = pack_q4_tiles(q, d, zero - 8.0 * d)
    stored = tiles[:, :, 256:].contiguous().view(torch.float16).view(3, k // 32, 2, 16)
    assert torch.equal(stored[:, :, 0].transpose(1, 2).reshape(n, k // 32), d16)
    assert torch.equal(stored[:, :, 1].transpose(1, 2).reshape(n, k // 32), m16)
