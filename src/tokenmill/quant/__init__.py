"""Linear-layer quantization methods: one file per method, registered by name.

    method = get_quant_method("int4")          # ValueError naming the supported ones otherwise
    load_and_quantize(model, weights, method, model_path)   # load (GGUF Q4_1 -> int4 directly), then pack

Only layers/ and this package know about quantization; a model just builds `Linear`s.
"""
from __future__ import annotations

import importlib
import logging

from torch import nn

from tokenmill.quant.base import QuantMethod

logger = logging.getLogger("tokenmill")

_METHODS = {
    "fp32": ("tokenmill.quant.unquantized", "UnquantizedMethod"),   # per-layer choice inside other methods
    "int8": ("tokenmill.quant.int8", "Int8WeightOnlyMethod"),
    "int4": ("tokenmill.quant.int4", "Int4WeightOnlyMethod"),
    "w8a8": ("tokenmill.quant.w8a8", "W8A8DynamicMethod"),
}


def supported_methods() -> list[str]:
    """The user-facing choices ("fp32" exists for per-layer choices inside other methods)."""
    return sorted(m for m in _METHODS if m != "fp32")


def get_quant_method(name: str) -> QuantMethod:
    if name not in _METHODS:
        raise ValueError(f"unknown quantization {name!r}; supported: {', '.join(supported_methods())} "
                         "(or None for the checkpoint's float weights)")
    module, cls = _METHODS[name]
    return getattr(importlib.import_module(module), cls)()


def quantize_model(model: nn.Module, method: str | QuantMethod | None,
                   quantize_tied_lm_head: bool | None = None) -> None:
    """Switch every `Linear` of a loaded model to `method` (None: leave float32) and pack its weights.

    An lm_head whose weight is the input embedding's gets a packed copy when the method asks for it
    (`quantize_tied_lm_head`, overridable here); otherwise it stays float32. Embeddings are never quantized.
    """
    from tokenmill.layers.linear import Linear
    if method is None:   # float32: the oneDNN copy and the tiles, made once now
        fp32 = get_quant_method("fp32")
        for layer in model.modules():
            if isinstance(layer, Linear):
                layer.set_quant_method(fp32)
        return
    method = get_quant_method(method) if isinstance(method, str) else method
    tied = quantize_tied_lm_head if quantize_tied_lm_head is not None else method.quantize_tied_lm_head
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    chosen = [(n, m) for n, m in layers if tied or id(m.weight) not in shared]
    others: dict[str, QuantMethod] = {}
    plan = []
    for prefix, layer in chosen:
        alt = method.method_for(prefix)
        plan.append((layer, method if alt is None else others.setdefault(alt, get_quant_method(alt))))
    for (prefix, _), (layer, m) in zip(chosen, plan):
        layer.prefix = prefix
        m.check_shape(layer)
    for layer, m in plan:
        layer.set_quant_method(m)
    logger.info("tokenmill: %s quantization of %d linear layers%s", method.name, len(chosen),
                "" if len(chosen) == len(layers) else " (tied lm_head kept float32)")


def load_and_quantize(model: nn.Module, weights, method: QuantMethod | None, model_path: str = "") -> None:
    """Load `weights` ((checkpoint name, float tensor) pairs) into `model` and quantize it with `method`.
    From a .gguf file whose blocks `method` takes as they are (Q4_1 -> int4), those are read directly
    from `model_path` instead, and `weights` is never consumed."""
    from tokenmill.quant.gguf_direct import load_gguf_direct
    direct = method is not None and model_path.endswith(".gguf") and load_gguf_direct(model, model_path, method)
    if not direct:
        model.load_weights(weights)
    quantize_model(model, method)
