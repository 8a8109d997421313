"""Linear-layer quantization methods: one file per method, registered by platform and name.

    method = get_quant_method("int4", "cpu")    # ValueError naming the supported ones otherwise

A method is the arithmetic of a `Linear` (layers/linear.py) on one platform; "float" is the checkpoint's
float weights in the compute dtype. Walking a model to apply methods is layers/quantize.py's job: this
package imports nothing from layers/.
"""
from __future__ import annotations

import contextlib
import importlib

from tokenmill.quant.base import QuantMethod

_METHODS = {   # platform -> name -> module:class, imported lazily
    "cpu": {"float": "tokenmill.quant.unquantized:UnquantizedMethod",
            "int8": "tokenmill.quant.int8:Int8WeightOnlyMethod",
            "int4": "tokenmill.quant.int4:Int4WeightOnlyMethod",
            "w8a8": "tokenmill.quant.w8a8:W8A8DynamicMethod",
            "fp8": "tokenmill.quant.fp8:FP8Method",
            "nvfp4": "tokenmill.quant.fp4:NVFP4Method",
            "mxfp4": "tokenmill.quant.fp4:MXFP4Method"},
    "cuda": {"float": "tokenmill.quant.cuda_float:CUDAFloatMethod",
             "int8": "tokenmill.quant.triton_weight_only:Int8TritonMethod",
             "int4": "tokenmill.quant.triton_weight_only:Int4TritonMethod",
             "fp8": "tokenmill.quant.scaled_mm_fp8:FP8ScaledMMMethod",
             "nvfp4": "tokenmill.quant.triton_fp4:NVFP4TritonMethod",
             "mxfp4": "tokenmill.quant.triton_fp4:MXFP4TritonMethod"},
}


def supported_methods(platform: str = "cpu") -> list[str]:
    """The user-facing choices on `platform` ("float", the default, is chosen by giving none)."""
    return sorted(m for m in _METHODS[platform] if m != "float")


def get_quant_method(name: str, platform: str = "cpu") -> QuantMethod:
    methods = _METHODS.get(platform, {})
    if name not in methods:
        raise ValueError(f"unknown quantization {name!r} on {platform}; supported there: "
                         f"{', '.join(supported_methods(platform))} (or None for the checkpoint's float weights)")
    module, cls = methods[name].split(":")
    return getattr(importlib.import_module(module), cls)()


# Formats with a CPU fast mode -> (method, the class attribute that turns it on; read when an engine is built).
# Their exact modes compute what the format means in float32 (each method's docstring says how).
_FAST_MODES = {"fp8": ("tokenmill.quant.fp8:FP8Method", "bf16_activations"),
               "nvfp4": ("tokenmill.quant.fp4:NVFP4Method", "int8_activations"),
               "mxfp4": ("tokenmill.quant.fp4:MXFP4Method", "int8_activations")}


@contextlib.contextmanager
def exact_mode(name: str):
    """Within: engines built run format `name` ("fp8", "nvfp4", "mxfp4") in its exact float32-activation mode
    (pre-quantized checkpoints of it included). For benchmarks and comparisons."""
    if name not in _FAST_MODES:
        raise ValueError(f"exact_mode: {name!r} has no fast mode; formats with one: {', '.join(sorted(_FAST_MODES))}")
    where, attr = _FAST_MODES[name]
    module, cls_name = where.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    saved = getattr(cls, attr)
    setattr(cls, attr, False)
    try:
        yield
    finally:
        setattr(cls, attr, saved)
