"""Linear-layer quantization methods: one file per method, registered by platform and name.

    method = get_quant_method("int4", "cpu")    # ValueError naming the supported ones otherwise

A method is the arithmetic of a `Linear` (layers/linear.py) on one platform; "float" is the checkpoint's
float weights in the compute dtype. Walking a model to apply methods is layers/quantize.py's job: this
package imports nothing from layers/.
"""
from __future__ import annotations

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
