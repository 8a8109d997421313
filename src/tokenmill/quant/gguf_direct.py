"""Load a GGUF file's quantized linear weights straight into a quant method's packed form.

Which block formats map onto which kernel without a float32 round trip:
    Q4_1 -> int4  exact: x = d*q + m  ==  (q - 8)*d + (m + 8*d), the kernel's (q - 8)*scale + zero with
                  group 32; m + 8*d of two float16s is exact in float32 (checked per tensor, else the
                  tensor goes the float32 way), and the kernel's fused multiply-add then rounds once,
                  like the dequantizer. tests/quant/test_gguf_direct.py checks it bit for bit.
    Q8_0 -> int8  not possible: one float16 scale per 32 values, and `_weight_int8pack_mm` takes one
                  scale per output channel, so Q8_0 is dequantized and requantized per channel.
Every other tensor (norms, embeddings, other types) is dequantized and loaded as usual.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

# ggml type name -> quant method name that can take it directly
DIRECT = {"Q4_1": "int4"}
Q4_1_BLOCK_BYTES, Q4_1_BLOCK = 20, 32      # d f16 | m f16 | 16 bytes of nibbles, per 32 values


def q4_1_to_int4(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]):
    """Q4_1 rows raw uint8 [N, K/32*20] -> (q [N, K] uint8 0..15, scale [N, K/32], zero [N, K/32] float32)
    with d*q + m == (q - 8)*scale + zero. Returns None if some m + 8*d is not exact in float32."""
    n, k = shape
    b = torch.from_numpy(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
    b = b.reshape(n, k // Q4_1_BLOCK, Q4_1_BLOCK_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()            # [N, K/32]
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = b[..., 4:]                                                                   # [N, K/32, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)    # low nibbles = values 0..15 of a block
    zero = m + 8.0 * d
    if not torch.equal(zero.double(), m.double() + 8.0 * d.double()):
        return None
    return q, d, zero


def load_gguf_direct(model: nn.Module, path: str, method) -> bool:
    """Load every weight of the GGUF file at `path` into `model`, Q4_1 linear weights straight into
    `method`'s packed form. Returns False (nothing loaded) when the method takes no GGUF format directly."""
    if method.name not in DIRECT.values():
        return False
    from tokenmill.layers.linear import Linear
    from tokenmill.loaders.gguf import GGUFFile, unpermute_rows
    from tokenmill.loaders.gguf_dequant import dequantize
    from gguf import GGMLQuantizationType

    f = GGUFFile(path)
    modules = dict(model.named_modules())
    raw = {name: (typ, shape, data) for name, typ, shape, data in f.iter_raw()}
    by_layer: dict[str, list[tuple[str, str | None]]] = {}
    for name in raw:
        layer_name, shard = _linear_target(name, model.STACKED)
        if isinstance(modules.get(layer_name), Linear) and name.endswith(".weight"):
            by_layer.setdefault(layer_name, []).append((name, shard))
    direct: set[str] = set()
    for layer_name, pieces in by_layer.items():
        layer = modules[layer_name]
        converted = [_convert(raw[n], f.needs_unpermute(n), unpermute_rows) for n, _ in pieces]
        if all(c is not None for c in converted) and _fill(layer, pieces, converted, method):
            direct.update(n for n, _ in pieces)
            layer.weight = None                     # not a parameter any more: load_weights skips it

    def rest():
        for name, (typ, shape, data) in raw.items():
            if name in direct:
                continue
            t = dequantize(data, GGMLQuantizationType[typ], shape)
            heads = f.needs_unpermute(name)
            yield name, (unpermute_rows(t, heads).contiguous() if heads else t)
    model.load_weights(rest())
    return True


def _linear_target(name: str, stacked) -> tuple[str, str | None]:
    """Checkpoint name -> (module name of the Linear it fills, shard id or None)."""
    module = name.rsplit(".", 1)[0]
    for fused, parts in stacked.items():
        for part, shard in parts:
            if module.endswith(f".{part}"):
                return module[: -len(part)] + fused, shard
    return module, None


def _convert(entry, heads: int, unpermute_rows):
    typ, shape, data = entry
    if DIRECT.get(typ) is None or len(shape) != 2:
        return None
    if heads:
        data = unpermute_rows(data, heads)
    return q4_1_to_int4(data, shape)


def _fill(layer, pieces, converted, method) -> bool:
    """Stack the shards' (q, scale, zero) in the layer's row order and pack them; False if rows mismatch."""
    rows = [layer.shard_rows(shard) for _, shard in pieces]
    order = sorted(range(len(pieces)), key=lambda i: rows[i].start)
    parts = [converted[i] for i in order]
    if sum(p[0].shape[0] for p in parts) != layer.out_features or parts[0][0].shape[1] != layer.in_features:
        return False
    q, scale, zero = (torch.cat([p[j] for p in parts]) for j in range(3))
    method.check_shape(layer)
    method.set_packed(layer, q, scale, zero)
    return True
