"""GGUF Q4_1 blocks straight into the int4 kernel: bit for bit what the float32 dequantizer gives."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tokenmill.layers.linear import Linear
from tokenmill.loaders.gguf_dequant import dequantize
from tokenmill.quant.gguf_direct import q4_1_to_int4
from tokenmill.quant.int4 import Int4WeightOnlyMethod


def kernel_weight(q, scale, zero) -> torch.Tensor:
    """The [N, K] weight the int4 kernel (float32 path) computes with: its output for x = identity."""
    n, k = q.shape
    layer = Linear(k, n)
    method = Int4WeightOnlyMethod(compute_dtype=torch.float32)
    method.set_packed(layer, q, scale, zero)
    layer.quant_method = method
    return layer(torch.eye(k)).T


def random_q4_1(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Q4_1 rows [n, k/32*20] with realistic float16 d > 0 and m < 0."""
    rng = np.random.default_rng(seed)
    blocks = np.empty((n, k // 32, 20), dtype=np.uint8)
    d = rng.uniform(1e-3, 5e-2, (n, k // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) * rng.uniform(0.5, 1.5, d.shape)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 4:] = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    return blocks.reshape(n, -1)


def test_q4_1_random_blocks_bit_exact():
    n, k = 64, 128
    raw = random_q4_1(n, k)
    ref = dequantize(raw, GGMLQuantizationType.Q4_1, (n, k))
    assert torch.equal(kernel_weight(*q4_1_to_int4(raw, (n, k))), ref)


def test_q4_1_default_model_tensors_bit_exact():
    from tokenmill.loaders.default_model import default_model_path
    from tokenmill.loaders.gguf import GGUFFile, unpermute_rows
    f = GGUFFile(default_model_path())
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.29.mlp.down_proj.weight", "model.layers.7.mlp.gate_proj.weight"}
    seen = 0
    for name, typ, shape, raw in f.iter_raw():
        if name not in wanted:
            continue
        assert typ == "Q4_1"
        heads = f.needs_unpermute(name)
        raw = unpermute_rows(raw, heads) if heads else raw
        ref = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType.Q4_1, shape)
        assert torch.equal(kernel_weight(*q4_1_to_int4(raw, shape)), ref), name
        seen += 1
    assert seen == len(wanted)


def test_inexact_zero_point_is_refused():
    raw = random_q4_1(16, 32)
    blocks = raw.reshape(16, 1, 20)
    blocks[0, 0, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)        # d = 1
    blocks[0, 0, 2:4] = np.array([2.0 ** -24], dtype=np.float16).view(np.uint8)  # m + 8 needs 28 bits
    assert q4_1_to_int4(raw, (16, 32)) is None


@pytest.mark.slow
def test_engine_loads_default_model_q4_1_directly():
    """LLM(quantization="int4") on the GGUF default model: every layer's linear weights come from the
    Q4_1 blocks (no float32 weight kept), identical in codes to quantizing the dequantized weights."""
    from tokenmill import LLM
    from tokenmill.quant.int4 import quantize_groupwise_int4
    from tokenmill.loaders.default_model import default_model_path
    from tokenmill.loaders.gguf import GGUFFile
    llm = LLM(quantization="int4", kv_cache_memory_bytes=1 << 24)
    model = llm.engine.core.runner.model
    layer = model.model.layers[3].mlp.down_proj
    assert layer.weight is None and layer.quant_method.name == "int4"
    dense = dict(GGUFFile(default_model_path()).iter_tensors())["model.layers.3.mlp.down_proj.weight"]
    q, scale, zero = quantize_groupwise_int4(dense)
    if getattr(layer, "q4_tiles", None) is not None:      # AVX-512 VNNI: the tiles are the only copy
        from tokenmill.quant.int4 import pack_q4_tiles
        assert getattr(layer, "int4_packed", None) is None
        assert torch.equal(layer.q4_tiles, pack_q4_tiles(q, scale, zero - 8.0 * scale))
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        assert torch.equal(layer.int4_packed, packed)
    assert model.lm_head.quant_method.name == "int8"     # tied head: an int8 copy of the Q8_0 embedding
