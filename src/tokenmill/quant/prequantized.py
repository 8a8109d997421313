"""Checkpoints already quantized by their producer: which format (from config.json's quantization_config or
ModelOpt's hf_quant_config.json), its tensors read into float weights plus the checkpoint's scales, which
the layer's method (quant/fp8.py) then uses to give back exactly the checkpoint's codes.

Supported: FP8 E4M3 weights, per tensor, per channel or in 128 x 128 blocks, from
- compressed-tensors (llm-compressor): `weight` float8_e4m3fn, `weight_scale` [1] / [N, 1] / [N/128, K/128]
  (config_groups weights: num_bits 8, type float, strategy tensor | channel | block);
- NVIDIA ModelOpt (quant_algo FP8): `weight`, `weight_scale` [] per tensor;
- DeepSeek-V3/R1 (quant_method fp8, weight_block_size [128, 128]): `weight`, `weight_scale_inv` per block
  (a multiplier, despite the name).
`input_scale` (static activation scales) is read and not used: activations stay float32 on the CPU.
Anything else (NVFP4, MXFP4, integer schemes, ...) is an error that names it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

SUPPORTED = "FP8 E4M3 weights per tensor, per channel or in 128x128 blocks"


@dataclass(frozen=True)
class CheckpointQuant:
    vendor: str                    # "compressed-tensors" | "modelopt" | "fp8" (DeepSeek's native format)
    strategy: str                  # "tensor" | "channel" | "block"
    scale_name: str                # "weight_scale" | "weight_scale_inv"
    method: str = "fp8"            # the quant/ method that serves it


def detect(hf_config, model_path: str) -> CheckpointQuant | None:
    """The checkpoint's pre-quantized format, None for a float checkpoint; ValueError for one not supported."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    modelopt = os.path.join(model_path, "hf_quant_config.json") if os.path.isdir(model_path) else ""
    if not qc and modelopt and os.path.exists(modelopt):
        with open(modelopt) as f:
            qc = {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
    if not qc:
        return None
    kind = qc.get("quant_method")
    if kind == "compressed-tensors":
        return _compressed_tensors(qc)
    if kind == "modelopt":
        algo = qc.get("quant_algo")
        if algo != "FP8":
            raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported; supported: {SUPPORTED}")
        return CheckpointQuant("modelopt", "tensor", "weight_scale")
    if kind == "fp8":
        block = qc.get("weight_block_size")
        if qc.get("fmt", "e4m3") != "e4m3" or (block is not None and list(block) != [128, 128]):
            raise ValueError(f"fp8 checkpoint format {qc.get('fmt')!r} with weight_block_size {block} is not "
                             f"supported; supported: {SUPPORTED}")
        return CheckpointQuant("fp8", "block" if block else "tensor", "weight_scale_inv" if block else "weight_scale")
    raise ValueError(f"pre-quantized checkpoint format quant_method={kind!r} is not supported; supported: "
                     f"{SUPPORTED} (compressed-tensors, ModelOpt, DeepSeek fp8)")


def _compressed_tensors(qc: dict) -> CheckpointQuant:
    strategies = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        ok = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("tensor", "channel", "block")
        if w.get("strategy") == "block" and list(w.get("block_structure") or [128, 128]) != [128, 128]:
            ok = False
        if not ok:
            raise ValueError(f"compressed-tensors scheme of {name} (weights num_bits={w.get('num_bits')}, "
                             f"type={w.get('type')}, strategy={w.get('strategy')}) is not supported; "
                             f"supported: {SUPPORTED}")
        strategies.add(w["strategy"])
    if len(strategies) != 1:
        raise ValueError(f"compressed-tensors: one weight strategy for every group is supported, got {sorted(strategies)}")
    return CheckpointQuant("compressed-tensors", strategies.pop(), "weight_scale")


def read_scales(iter_weights, fmt: CheckpointQuant) -> dict[str, torch.Tensor]:
    """The checkpoint's weight scales by module name (one pass over the lazy checkpoint: only they are read)."""
    from tokenmill.loaders.lazy import read_part
    suffix = "." + fmt.scale_name
    return {name[: -len(suffix)]: read_part(t, slice(None), slice(None)).float()
            for name, t in iter_weights() if name.endswith(suffix)}


def dequantized_weights(iter_weights, fmt: CheckpointQuant, scales: dict[str, torch.Tensor]):
    """(checkpoint name, tensor) pairs, each FP8 weight dequantized by its scale as it is read (one at a
    time), the scale tensors themselves left out."""
    from tokenmill.loaders.lazy import read_part
    from tokenmill.quant.fp8 import BLOCK, dequantize, expand_scale
    for name, t in iter_weights():
        if name.endswith(("." + fmt.scale_name, ".input_scale", ".weight_scale_2")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module not in scales:
            yield name, t
            continue
        q = read_part(t, slice(None), slice(None))
        if q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: a {fmt.vendor} FP8 weight must be float8_e4m3fn, got {q.dtype}")
        kblock = BLOCK if fmt.strategy == "block" else q.shape[1]
        yield name, dequantize(q, expand_scale(q.float(), fmt.strategy, scales[module], kblock), kblock)


def attach_scales(model, scales: dict[str, torch.Tensor], fmt: CheckpointQuant) -> set[str]:
    """Give each Linear the checkpoint's scales of its shards (`checkpoint_fp8`: rows in the layer, strategy,
    this rank's part of the scale); returns the names of the layers that got them (the others the
    checkpoint keeps in float)."""
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.quantize import _linear_target
    from tokenmill.quant.fp8 import BLOCK
    modules = dict(model.named_modules())
    done = set()
    for ckpt_module, scale in scales.items():
        layer_name, shard = _linear_target(ckpt_module + ".weight", model.STACKED)
        layer = modules.get(layer_name)
        if not isinstance(layer, Linear):
            continue
        rows, cols = layer.checkpoint_slice(shard)
        part = scale
        if fmt.strategy == "channel":
            part = scale.reshape(-1)[rows]
        elif fmt.strategy == "block":
            for s in (rows, cols):
                if s.start not in (None, 0) and s.start % BLOCK:
                    raise ValueError(f"{layer_name}: this rank's part does not start on a {BLOCK}-block boundary; "
                                     "use a tensor-parallel size that splits the blocks evenly")
            r0 = (rows.start or 0) // BLOCK
            r1 = None if rows.stop is None else -(-rows.stop // BLOCK)
            c0 = (cols.start or 0) // BLOCK
            c1 = None if cols.stop is None else -(-cols.stop // BLOCK)
            part = scale[r0:r1, c0:c1]
        target_rows = layer.shard_rows(shard) if shard is not None else slice(0, layer.out_features)
        layer.checkpoint_fp8 = getattr(layer, "checkpoint_fp8", []) + [(target_rows, fmt.strategy, part)]
        done.add(layer_name)
    return done
