"""NVFP4's and MXFP4's fast mode on the native tile kernels (csrc/gemv_kernels.cpp gemv_nvfp4): exactly the
dequantized weight times activations quantized to int8 per group of 32 (float64 reference), every E2M1 code
and E4M3 scale byte included; the tile layout; MXFP4's power-of-two scales re-expressed as E4M3 blocks under a
row scale exactly (or refused, and the layer left on the grouped kernel); Linear keeping only the tiles and
running them at every step size; the fused decode program taking FP4 layers; an engine in the fast mode
close to the reference mode."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.linear import Linear
from tokenmill.layers.quantize import quantize_model
from tokenmill.quant import fp4, tile_kernels
from test_tile_kernels import quantized_activations, rel_err  # tests/quant, on sys.path (no __init__)

native = tile_kernels.kernels()
pytestmark = pytest.mark.skipif(native is None, reason="tile kernels need AVX-512 VNNI and a compiler")
SCALE_BYTES = torch.arange(256, dtype=torch.uint8)[(torch.arange(256) & 0x7F) != 0x7F]   # every non-NaN E4M3


def _random_nvfp4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = SCALE_BYTES[torch.randint(0, len(SCALE_BYTES), (n, k // 16), generator=g)].view(torch.float8_e4m3fn)
    row_scale = torch.rand(n, generator=g) + 0.5
    w = fp4.from_e2m1(codes).double() * scale.double().repeat_interleave(16, 1) * row_scale.double()[:, None]
    return fp4.pack(codes), scale, row_scale, w


@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (36, 1536), (20, 96)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 37])
def test_nvfp4_kernel_is_the_dequantized_weight_on_int8_activations(n, k, m):
    packed, scale, row_scale, w = _random_nvfp4(n, k, n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    tiles, tile_scale = fp4.pack_nvfp4_tiles(packed, scale, row_scale)
    assert tiles.shape == (-(-n // 16), k // 32, 288) and tile_scale.shape == (16 * tiles.shape[0],)
    y = native.gemv_nvfp4(x, tiles, tile_scale, n)
    ref = quantized_activations(x) @ w.T
    assert y.shape == (m, n) and rel_err(y, ref) < 1e-5


def test_nvfp4_kernel_reads_strided_rows_as_contiguous_ones():
    """Rows of x a slice of wider rows (as a fused projection's output is): the kernel regroups them per tile
    of 6 rows, whatever their stride; 13 rows are two full tiles and one of a single row."""
    packed, scale, row_scale, _ = _random_nvfp4(48, 96, 7)
    tiles, tile_scale = fp4.pack_nvfp4_tiles(packed, scale, row_scale)
    wide = torch.randn(13, 160, generator=torch.Generator().manual_seed(8))
    strided = wide[:, 32:128]
    assert strided.stride(0) == 160
    assert torch.equal(native.gemv_nvfp4(strided, tiles, tile_scale, 48),
                       native.gemv_nvfp4(strided.contiguous(), tiles, tile_scale, 48))


def test_every_code_and_scale_byte_decodes_exactly():
    """One input at a time (x a one-hot row: quantized to 127 x (1 / 127), 1 to float32 rounding) reads one
    weight back."""
    n, k = 16, 32 * 16
    codes = (torch.arange(n * k) % 16).to(torch.uint8).view(n, k)
    scale = SCALE_BYTES.repeat(3)[:n * k // 16].view(n, k // 16).view(torch.float8_e4m3fn)
    row_scale = 2.0 ** torch.arange(-8, 8).float()                          # powers of two: exact products
    tiles, tile_scale = fp4.pack_nvfp4_tiles(fp4.pack(codes), scale, row_scale)
    y = native.gemv_nvfp4(torch.eye(k), tiles, tile_scale, n)              # [k, n]: y[j] = w[:, j]
    w = fp4.from_e2m1(codes) * scale.float().repeat_interleave(16, 1) * row_scale[:, None]
    torch.testing.assert_close(y.t(), w, rtol=1e-6, atol=0.0)


def test_tiles_hold_the_codes_and_scale_bytes_as_they_are():
    packed, scale, row_scale, _ = _random_nvfp4(20, 64, 3)
    tiles, tile_scale = fp4.pack_nvfp4_tiles(packed, scale, row_scale)
    assert tiles.shape == (2, 2, 288)
    magnitude = scale.view(torch.uint8) & 0x7F       # a negative scale's sign moves into its block's codes
    # group 1 of block 0: scale bytes of rows 0..15, half 0 then half 1
    assert torch.equal(tiles[0, 1, 256:272], magnitude[:16, 2]) and torch.equal(tiles[0, 1, 272:288], magnitude[:16, 3])
    assert torch.equal(tiles[1, 0, 256:260], magnitude[16:20, 0]) and not tiles[1, 0, 260:272].any()
    assert torch.equal(tile_scale[:20], row_scale * 128) and not tile_scale[20:].any()
    codes = fp4.unpack(packed) ^ (((scale.view(torch.uint8) >> 7) * 8).repeat_interleave(16, 1))
    # chunk c, byte 4 i + j: row i's input 8c + j (low nibble) and 8c + 4 + j (high)
    assert tiles[0, 0, 64 * 2 + 4 * 5 + 1].item() == codes[5, 17].item() | (codes[5, 21].item() << 4)
    assert (scale.view(torch.uint8) >> 7).any()      # the case above was exercised


def _random_mxfp4(n: int, k: int, seed: int, spread: int = 17):
    """Codes and power-of-two scales [n, k / 32]: per row, exponents over `spread` + 1 binades around a row
    offset (-100 .. 100), and some blocks of zero codes with scales far outside that range."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    exponent = torch.randint(-100, 100, (n, 1), generator=g) + torch.randint(0, spread + 1, (n, k // 32), generator=g)
    zero = torch.rand(n, k // 32, generator=g) < 0.2
    exponent = torch.where(zero, exponent - 40, exponent)
    codes.view(n, k // 32, 32)[zero] = torch.randint(0, 2, (int(zero.sum()), 32), dtype=torch.uint8, generator=g) * 8
    return fp4.pack(codes), torch.exp2(exponent.float())              # codes 0 / 8: +0 / -0


@pytest.mark.parametrize("seed", range(4))
def test_mxfp4_scales_as_nvfp4_give_back_every_weight(seed):
    packed, scales = _random_mxfp4(40, 256, seed)
    block_scale, row_scale = fp4.mxfp4_as_nvfp4(packed, scales)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (40, 16) and row_scale.shape == (40,)
    as_nvfp4 = fp4.dequantize(packed, block_scale.float() * row_scale[:, None], 16)
    assert torch.equal(as_nvfp4, fp4.dequantize(packed, scales, 32))
    rows = torch.log2(row_scale)
    assert torch.equal(rows, rows.round())                            # a power of two: the kernel's product is exact


def test_mxfp4_scales_outside_e4m3s_range_are_refused_and_the_layer_keeps_the_grouped_kernel():
    packed, scales = _random_mxfp4(16, 64, 0, spread=0)
    codes = fp4.unpack(packed)
    codes[3, :32] = 2                                                  # a block that holds values, 2^18 below
    scales[3, 0], scales[3, 1] = 2.0 ** -20, 2.0 ** -2
    codes[3, 32:] = 2
    packed = fp4.pack(codes)
    assert fp4.mxfp4_as_nvfp4(packed, scales) is None
    assert fp4.mxfp4_as_nvfp4(packed, scales * 1.5) is None            # not powers of two
    scales[3, 0] = 2.0 ** -19                                          # 2^17 below: E4M3's smallest subnormal
    assert fp4.mxfp4_as_nvfp4(packed, scales) is not None
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    w[3, :32] *= 2.0 ** -24                                            # quantized at load: scales 2^24 apart
    layer = Linear(64, 16)
    layer.weight.data.copy_(w)
    layer.set_quant_method(fp4.MXFP4Method())
    assert hasattr(layer, "fp4_weight") and not hasattr(layer, "fp4_tiles") and layer.tile_fn is None
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ref = x @ fp4.dequantize(layer.fp4_weight[0], fp4.FP4Method.float_scales(layer), 32).T
    # the same float32 products summed in another order: off by about an ulp of sum |x_i w_i| (at most 51 here,
    # an ulp 3.8e-6; measured 2.1e-6), hence atol 1e-5
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,block", [("nvfp4", 16), ("mxfp4", 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_keeps_only_the_tiles_and_runs_them_at_every_step_size(method, block, bias):
    g = torch.Generator().manual_seed(4)
    layer = Linear(96, 40, bias=bias)
    layer.weight.data.copy_(torch.randn(40, 96, generator=g))
    if bias:
        layer.bias.data.copy_(torch.randn(40, generator=g))
    reference = Linear(96, 40, bias=bias)
    reference.load_state_dict(layer.state_dict())
    cls = {"nvfp4": fp4.NVFP4Method, "mxfp4": fp4.MXFP4Method}[method]
    layer.set_quant_method(cls())
    reference.set_quant_method(cls(int8_activations=False))
    assert layer.fp4_tiles.dtype == torch.uint8 and not hasattr(layer, "fp4_weight")
    assert layer.quant_method.tile_weights(layer)[0] == "nvfp4" and layer.tile_max_rows > 10 ** 6
    w = fp4.dequantize(reference.fp4_weight[0], fp4.FP4Method.float_scales(reference), block).double()
    for rows in (1, 2, 7, 300):
        x = torch.randn(rows, 96, generator=g)
        ref = quantized_activations(x) @ w.T + (reference.bias.double() if bias else 0)
        assert rel_err(layer(x), ref) < 1e-5
        assert rel_err(layer.quant_method.apply(layer, x), ref) < 1e-5


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_fast_mode_engine_stays_close_to_the_reference_and_decodes_natively(tiny_model_factory, monkeypatch, method):
    from tokenmill import LLM, SamplingParams
    from test_engine_quant import prompt_logits
    model_dir = tiny_model_factory("llama", tie_word_embeddings=False)
    ids = torch.randint(100, 40000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    fast = LLM(model_dir, quantization=method, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    monkeypatch.setattr({"nvfp4": fp4.NVFP4Method, "mxfp4": fp4.MXFP4Method}[method], "int8_activations", False)
    exact = LLM(model_dir, quantization=method, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    down = fast.engine.core.runner.model.model.layers[0].mlp.down_proj
    assert hasattr(down, "fp4_tiles") and hasattr(exact.engine.core.runner.model.model.layers[0].mlp.down_proj,
                                                  "fp4_weight")
    a, b = prompt_logits(fast, ids), prompt_logits(exact, ids)
    err = ((a - b).norm() / b.norm()).item()
    assert 0 < err < 0.02                 # int8 activations per 32 (measured about 0.004 here)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fast.generate([ids], params)
    program = fast.engine.core.runner.fused_decode
    assert program is not None and program.steps > 0                     # FP4 layers in the native decode layer
