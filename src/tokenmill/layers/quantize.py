"""Putting quantization methods (tokenmill.quant) onto a model's `Linear`s: after loading, or while
loading for GGUF blocks a method takes as they are.

    load_and_quantize(model, weights, method, model_path)   # method from Platform.quant_method
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.quant import get_quant_method
from tokenmill.quant.base import QuantMethod
from tokenmill.quant.gguf_direct import BLOCK_BYTES, CONVERTERS, GGUF_BLOCK

logger = logging.getLogger("tokenmill")


def quantize_model(model: nn.Module, method: str | QuantMethod | None,
                   quantize_tied_lm_head: bool | None = None, keep_float=None, own_codes=None) -> None:
    """Switch every `Linear` of a loaded model to `method` and pack its weights (None or a "float" method:
    the checkpoint's float weights, packed for the platform's float kernels, once, now).

    An lm_head whose weight is the input embedding's gets a packed copy when the method asks for it
    (`quantize_tied_lm_head`, overridable here); otherwise it keeps the float tensor it shares, computed
    by the platform's float method. Embeddings are never quantized. keep_float(prefix): layers that stay float
    (those a pre-quantized checkpoint keeps in float); own_codes(prefix): layers that already hold `method`'s
    codes (a pre-quantized checkpoint's, its lm_head included), which keep `method` whatever method_for says."""
    method = get_quant_method(method or "float") if method is None or isinstance(method, str) else method
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    if method.is_float:
        for _, layer in layers:
            layer.set_quant_method(method)
        return
    tied = quantize_tied_lm_head if quantize_tied_lm_head is not None else method.quantize_tied_lm_head
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    chosen = [(n, m) for n, m in layers if tied or id(m.weight) not in shared]
    others: dict[str, QuantMethod] = {}
    plan = []
    for prefix, layer in chosen:
        alt = _alternative(method, prefix, keep_float, own_codes)
        plan.append((layer, method if alt is None else others.setdefault(alt, get_quant_method(alt, method.platform))))
    for (prefix, _), (layer, m) in zip(chosen, plan):
        layer.prefix = prefix
        m.check_shape(layer)
    for layer, m in plan:
        layer.set_quant_method(m)
    kept = [layer for _, layer in layers if all(layer is not c for _, c in chosen)]
    if kept:             # the shared float tensor, unpacked: the float method takes it as it is
        float_method = get_quant_method("float", method.platform)
        for layer in kept:
            layer.quant_method = float_method
    logger.info("tokenmill: %s quantization of %d linear layers%s", method.name, len(chosen),
                "" if not kept else " (tied lm_head kept float)")


def _alternative(method: QuantMethod, prefix: str, keep_float, own_codes) -> str | None:
    """The method name layer `prefix` takes instead of `method`, or None for `method` itself."""
    if keep_float is not None and keep_float(prefix):
        return "float"
    if own_codes is not None and own_codes(prefix):
        return None                  # its weight is gone: only `method` can take the codes it was given
    return method.method_for(prefix)


def load_and_quantize(model: nn.Module, weights, method: QuantMethod | None, model_path: str = "") -> None:
    """Load `weights` ((checkpoint name, float tensor) pairs) into `model` and quantize it with `method`.
    From a .gguf file whose blocks `method` takes as they are (Q4_1 -> int4), those are read directly
    from `model_path` instead, and `weights` is never consumed."""
    direct = method is not None and model_path.endswith(".gguf") and load_gguf_direct(model, model_path, method)
    if not direct:
        model.load_weights(weights)
    quantize_model(model, method)


def load_prequantized(model: nn.Module, iter_weights, fmt, method: QuantMethod) -> None:
    """A pre-quantized checkpoint (quant/prequantized.py). For the format's own method (fp8, nvfp4, mxfp4)
    each quantized layer takes the checkpoint's codes as they are, with its scales (no float copy of the
    weight is made) and its activation scheme, and keeps that method (an lm_head the checkpoint quantizes
    included: it never takes method_for's head method); the layers it keeps in float stay so. Another method
    gets the weights dequantized as read and quantizes them as usual."""
    from tokenmill.quant.prequantized import (attach_input_quant, attach_scales, dequantized_weights,
                                              read_input_scales, read_scales)
    source = iter_weights
    iter_weights = lambda: model.checkpoint_tensors(source())        # noqa: E731  (the model's view of the file)
    scales = read_scales(iter_weights, fmt)
    if method is None or method.name != fmt.method:
        model.load_weights(dequantized_weights(iter_weights, fmt, scales))
        quantize_model(model, method)
        return
    quantized = attach_scales(model, scales, fmt)
    sink = _CodeSink(model, quantized, method, fmt)
    model.load_weights(dequantized_weights(iter_weights, fmt, scales, sink.take))
    sink.check_complete()
    quantize_model(model, method, keep_float=lambda prefix: prefix not in quantized,
                   own_codes=quantized.__contains__)
    attach_input_quant(model, quantized, read_input_scales(iter_weights, fmt), fmt)


class _CodeSink:
    """Takes a pre-quantized checkpoint's codes into their layers as they are read: each layer's float
    weight is dropped before loading (never filled), its shards' codes (this rank's rows and columns)
    collected, and handed to method.set_codes once every row of the layer has them."""

    def __init__(self, model: nn.Module, layers: set[str], method: QuantMethod, fmt) -> None:
        self.model, self.method, self.fmt = model, method, fmt
        self.modules = dict(model.named_modules())
        self.pending = {name: [] for name in layers}          # layer name -> [(rows in the layer, codes)]
        self.devices = {}
        for name in layers:
            self.devices[name] = self.modules[name].weight.device
            self.modules[name].weight = None

    def take(self, ckpt_module: str, tensor) -> bool:
        from tokenmill.loaders.lazy import read_part
        layer_name, shard = _linear_target(self.model.checkpoint_name(ckpt_module + ".weight"), self.model.STACKED)
        if layer_name not in self.pending:
            return False
        layer = self.modules[layer_name]
        rows, cols = layer.checkpoint_slice(shard)
        if self.fmt.fp4_group:                           # two codes a byte: this rank's columns' bytes
            cols = slice(None if cols.start is None else cols.start // 2, None if cols.stop is None else cols.stop // 2)
        target = layer.shard_rows(shard) if shard is not None else slice(0, layer.out_features)
        parts = self.pending[layer_name]
        parts.append((target, read_part(tensor, rows, cols)))
        if sum(codes.shape[0] for _, codes in parts) == layer.out_features:
            layer.prefix = layer_name                    # for set_codes' errors
            self.method.set_codes(layer, parts, self.devices[layer_name])
            del self.pending[layer_name]
        return True

    def check_complete(self) -> None:
        if self.pending:
            name = sorted(self.pending)[0]
            raise ValueError(f"checkpoint is missing the {self.fmt.weight_name} tensors of {name} (it has their scales)")


def load_gguf_direct(model: nn.Module, path: str, method: QuantMethod) -> bool:
    """Load every weight of the GGUF file at `path` into `model`, Q4_1 linear weights straight into
    `method`'s packed form (no float copy of them on the host). Returns False (nothing loaded) when the
    method takes no GGUF format directly."""
    if not method.direct_gguf_types:
        return False
    from tokenmill.loaders.gguf import GGUFFile, unpermute_rows
    from tokenmill.loaders.lazy import GGUFTensor
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
        converted = [_convert(raw[n], f.needs_unpermute(n), unpermute_rows, method, *layer.checkpoint_slice(shard))
                     for n, shard in pieces]
        if all(c is not None for c in converted) and _fill(layer, pieces, converted, method):
            direct.update(n for n, _ in pieces)
            layer.weight = None                     # not a parameter any more: load_weights skips it
    f.check_dequantizable(direct)                   # the rest is dequantized: a type it cannot take is named

    def rest():            # dequantized as read: only a tensor-parallel rank's part
        for name, (typ, shape, data) in raw.items():
            if name not in direct:
                yield name, GGUFTensor(data, GGMLQuantizationType[typ], shape, f.needs_unpermute(name))
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


def _convert(entry, heads: int, unpermute_rows, method, rows: slice, cols: slice):
    """(block type, the method's set_packed arguments for this rank's rows and columns of the tensor) or
    None if it goes the float way (a type the method does not take, columns off block boundaries)."""
    typ, shape, data = entry
    if typ not in method.direct_gguf_types or len(shape) != 2:
        return None
    if heads:
        data = unpermute_rows(data, heads)
    data = data[rows]
    start, stop, _ = cols.indices(shape[1])
    if (start, stop) != (0, shape[1]):
        if start % GGUF_BLOCK or stop % GGUF_BLOCK:
            return None
        per_block = BLOCK_BYTES[typ]
        data = data[:, start // GGUF_BLOCK * per_block: stop // GGUF_BLOCK * per_block]
    packed = CONVERTERS[typ](data, (data.shape[0], stop - start))
    return None if packed is None else (typ, packed)


def _fill(layer, pieces, converted, method) -> bool:
    """Stack the shards' packed arguments (this rank's part of each) in the layer's row order and pack
    them; False if rows or block types mismatch."""
    if len({typ for typ, _ in converted}) != 1:
        return False
    rows = [layer.shard_rows(shard) for _, shard in pieces]
    order = sorted(range(len(pieces)), key=lambda i: rows[i].start)
    parts = [converted[i][1] for i in order]
    if sum(p[0].shape[0] for p in parts) != layer.out_features or parts[0][0].shape[1] != layer.in_features:
        return False
    method.check_shape(layer)
    method.set_packed(layer, *(torch.cat([p[j] for p in parts]) for j in range(len(parts[0]))))
    return True
