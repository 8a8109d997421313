"""The CUDA weight-only kernels (quant/triton_weight_only.py) against a dequantized float matmul: row
counts across the kernel's block sizes, widths that are not a multiple of its tile, bias, and the GGUF
Q4_1 / Q8_0 blocks loaded as they are. On a machine without a GPU they run under Triton's interpreter."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")

from tokenmill.layers.linear import Linear  # noqa: E402
from tokenmill.quant import get_quant_method  # noqa: E402
from tokenmill.quant.gguf_direct import q4_1_to_int4, q8_0_to_int8  # noqa: E402
from tokenmill.quant.int4 import quantize_groupwise_int4  # noqa: E402
from tokenmill.quant.triton_weight_only import (int4_matmul, int8_matmul, pack_int4,  # noqa: E402
                                                quantize_int8_groups)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _x(rows, k, seed=0):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 5, 17, 40])
@pytest.mark.parametrize("n", [64, 100])
def test_int8_kernel_is_the_dequantized_matmul(rows, n):
    k = 96
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    q, d = quantize_int8_groups(w)
    dequant = (q.float().view(n, k // 32, 32) * d.unsqueeze(2)).view(n, k)
    assert (dequant - w).abs().max() <= d.max() / 2 + 1e-6              # round to nearest per group
    x = _x(rows, k)
    y = int8_matmul(x, q.t().contiguous().to(DEVICE), d.t().contiguous().to(DEVICE))
    torch.testing.assert_close(y.cpu(), x.cpu() @ dequant.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 16, 33])
@pytest.mark.parametrize("n", [64, 80])
def test_int4_kernel_is_the_dequantized_matmul(rows, n):
    k = 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(2))
    q, scale, zero = quantize_groupwise_int4(w)
    dequant = ((q.float() - 8).view(n, k // 32, 32) * scale.unsqueeze(2) + zero.unsqueeze(2)).view(n, k)
    x = _x(rows, k, seed=3)
    y = int4_matmul(x, pack_int4(q).to(DEVICE), scale.t().contiguous().to(DEVICE),
                    (zero - 8 * scale).t().contiguous().to(DEVICE))
    torch.testing.assert_close(y.cpu(), x.cpu() @ dequant.t(), rtol=1e-5, atol=1e-4)


def test_pack_int4_puts_each_group_in_q4_1_nibble_order():
    q = torch.arange(64).remainder(16).view(1, 64).repeat(2, 1)
    packed = pack_int4(q)                                           # [32, 2]
    assert packed.shape == (32, 2)
    assert packed[0, 0] == (q[0, 0] | (q[0, 16] << 4)) and packed[17, 1] == (q[1, 33] | (q[1, 49] << 4))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_methods_on_a_linear_layer(name, bias):
    torch.manual_seed(4)
    with torch.device(DEVICE):
        layer = Linear(64, 48, bias=bias)
    w = torch.randn(48, 64) * 0.05
    layer.weight.data.copy_(w)
    if bias:
        layer.bias.data.copy_(torch.randn(48))
    method = get_quant_method(name, "cuda")
    method.check_shape(layer)
    layer.set_quant_method(method)
    assert layer.weight is None and layer.qweight.device.type == DEVICE
    x = _x(3, 64, seed=5)
    ref = torch.nn.functional.linear(x.cpu(), w, None if not bias else layer.bias.cpu())
    rel = ((layer(x).cpu() - ref).norm() / ref.norm()).item()
    assert rel < {"int8": 0.01, "int4": 0.1}[name]


def test_the_shape_check_names_the_layer():
    layer = Linear(48, 64)
    layer.prefix = "model.layers.0.mlp.down_proj"
    with pytest.raises(ValueError, match=r"int8 quantization of model.layers.0.mlp.down_proj \[64, 48\]"):
        get_quant_method("int8", "cuda").check_shape(layer)


def _q8_0_blocks(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half()
    qs = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    raw = torch.cat([d.unsqueeze(2).view(torch.uint8).view(n, k // 32, 2), qs.view(torch.uint8)], dim=2)
    return raw.reshape(n, k // 32 * 34), (qs.float() * d.float().unsqueeze(2)).view(n, k)


def test_q8_0_blocks_load_into_int8_exactly():
    raw, values = _q8_0_blocks(32, 64, seed=6)
    q, d = q8_0_to_int8(raw, (32, 64))
    layer = Linear(64, 32)
    method = get_quant_method("int8", "cuda")
    method.set_packed(layer.to(DEVICE), q, d)
    x = torch.eye(64).to(DEVICE)                                    # x = I: the kernel returns W^T itself
    torch.testing.assert_close(int8_matmul(x, layer.qweight, layer.scales).cpu(), values.t(), rtol=0, atol=0)


def test_q4_1_blocks_load_into_int4_exactly():
    from gguf import GGMLQuantizationType
    from tests.quant.test_gguf_direct import random_q4_1
    from tokenmill.loaders.gguf_dequant import dequantize
    raw = random_q4_1(32, 64, seed=7)
    values = dequantize(raw, GGMLQuantizationType.Q4_1, (32, 64))
    q, scale, zero = q4_1_to_int4(raw, (32, 64))
    layer = Linear(64, 32).to(DEVICE)
    get_quant_method("int4", "cuda").set_packed(layer, q, scale, zero)
    x = torch.eye(64).to(DEVICE)
    torch.testing.assert_close(int4_matmul(x, layer.qweight, layer.scales, layer.mins).cpu(),
                               values.t(), rtol=1e-6, atol=0)           # one rounding apart at most
