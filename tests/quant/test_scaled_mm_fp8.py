"""The CUDA FP8 method (quant/scaled_mm_fp8.py: FP8 weights and per-token FP8 activations through
torch._scaled_mm), run here through torch's CPU _scaled_mm: exactly the arithmetic it states (row scales,
128 x 128 weight blocks and groups of 32 inputs with per-token-group activations), and within FP8's error of the
float layer."""
from __future__ import annotations

import pytest
import torch

from tokenmill.layers.linear import Linear
from tokenmill.layers.quantize import quantize_model
from tokenmill.quant import fp8
from tokenmill.quant.activations import fp8_codes as quantize_activations
from tokenmill.quant.scaled_mm_fp8 import FP8ScaledMMMethod


def _layer(n: int, k: int, seed: int) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(k, n)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 0.5, n).unsqueeze(1)
    layer.weight.data.copy_(w)
    return layer, w


def _by_hand(layer, x: torch.Tensor, kblock: int) -> torch.Tensor:
    """(xq * xs) @ (wq * ws)^T in float64 from the layer's own codes and scales."""
    xq, xs = quantize_activations(x, kblock)
    xd = xq.double() * xs.double().repeat_interleave(kblock, dim=1)
    ws = layer.fp8_scale[:, 0, :].t().double().repeat_interleave(kblock, dim=1)      # [N, K]
    return xd @ (layer.fp8_weight.double() * ws).t()


def test_activations_quantize_per_token_and_group():
    x = torch.randn(5, 256) * torch.tensor([1e-3, 1.0, 10.0, 300.0, 0.0]).unsqueeze(1)
    for group in (256, 128):
        codes, scale = quantize_activations(x, group)
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (5, 256 // group)
        back = codes.float() * scale.repeat_interleave(group, dim=1)
        assert torch.allclose(back, x, rtol=2 ** -4, atol=1e-30)
        assert (codes.float().abs().amax(dim=1)[:4] == 448).all()          # each row's amax lands on 448


def test_row_scales_are_the_stated_arithmetic_and_close_to_float():
    layer, w = _layer(48, 256, 0)
    quantize_model(layer, FP8ScaledMMMethod())
    assert layer.fp8_weight.dtype == torch.float8_e4m3fn and layer.fp8_kblock == 256
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    ref = _by_hand(layer, x, 256)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    exact = x @ w.t()
    assert ((y - exact).norm() / exact.norm()).item() < 0.06                   # both operands in E4M3


def test_block_checkpoint_scales_take_per_group_activations():
    layer, w = _layer(160, 256, 2)
    blocks = torch.rand(2, 2) * 0.01 + 0.002                                     # [ceil(160/128), 256/128]
    layer.checkpoint_fp8 = [(slice(0, 160), "block", blocks)]
    quantize_model(layer, FP8ScaledMMMethod())
    assert layer.fp8_kblock == fp8.BLOCK and layer.fp8_scale.shape == (2, 1, 160)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    y = layer(x)
    ref = _by_hand(layer, x, fp8.BLOCK)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_group_checkpoint_scales_take_activations_per_group():
    """compressed-tensors "group" scales (one per row and 32 inputs): one _scaled_mm per group, the activations
    quantized per token and group of 32 (the weight's scale groups), exactly the stated arithmetic."""
    layer, w = _layer(160, 256, 4)
    groups = torch.rand(160, 8, generator=torch.Generator().manual_seed(5)) * 0.01 + 0.002      # [N, K / 32]
    layer.checkpoint_fp8 = [(slice(0, 160), "group", groups)]
    quantize_model(layer, FP8ScaledMMMethod())
    assert layer.fp8_kblock == 32 and layer.fp8_scale.shape == (8, 1, 160)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    ref = _by_hand(layer, x, 32)
    assert ((layer(x).double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_shapes_off_the_alignment_are_refused():
    layer, _ = _layer(40, 100, 4)
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_model(layer, FP8ScaledMMMethod())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("blocks", [False, True])
def test_this_cuda_build_takes_the_scaled_mm_calls(dtype, blocks):
    """On the GPU: this build takes torch._scaled_mm with unit tensor-wise scales and a float32 output (row-wise
    scales with a float32 output need sm90 and cuBLAS >= 12.9, which older builds lack), and the layer gives
    the stated arithmetic, row scales and 128 x 128 blocks, from bf16 and float32 inputs."""
    from tokenmill.quant.activations import fp8_codes
    n, k = (160, 256) if blocks else (48, 256)
    g = torch.Generator().manual_seed(0)
    layer = Linear(k, n)
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 0.5, n).unsqueeze(1)
    layer.weight.data.copy_(w)
    if blocks:
        layer.checkpoint_fp8 = [(slice(0, n), "block", torch.rand(2, 2, generator=g) * 0.01 + 0.002)]
    quantize_model(layer, FP8ScaledMMMethod())
    layer = layer.cuda()
    kblock = layer.fp8_kblock
    assert kblock == (fp8.BLOCK if blocks else k)
    x = torch.randn(7, k, generator=g).to("cuda", dtype)          # 7 rows: padded to 16 for cuBLAS
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, n)
    xq, xs = fp8_codes(x, kblock)
    xd = xq.double().cpu() * xs.double().cpu().repeat_interleave(kblock, dim=1)
    ws = layer.fp8_scale[:, 0, :].t().double().cpu().repeat_interleave(kblock, dim=1)
    ref = xd @ (layer.fp8_weight.double().cpu() * ws).t()
    rel = ((y.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 8e-3), f"{dtype}, blocks={blocks}: relative error {rel:.3g}"
