"""Checkpoints already quantized by their producer: which format (from config.json's quantization_config or
ModelOpt's hf_quant_config.json), its tensors read into float weights plus the checkpoint's scales, which
the layer's method (quant/fp8.py) then uses to give back exactly the checkpoint's codes.

Supported: FP8 E4M3 weights, per tensor, per channel, in 128 x 128 blocks or per row and group of inputs, from
- compressed-tensors (llm-compressor): `weight` float8_e4m3fn, `weight_scale` [1] / [N, 1] / [N/128, K/128] /
  [N, K/group] (config_groups weights: num_bits 8, type float, strategy tensor | channel | block | group with
  group_size 16, 32 or a multiple of 64);
- NVIDIA ModelOpt (quant_algo FP8): `weight`, `weight_scale` [] per tensor;
- DeepSeek-V3/R1 (quant_method fp8, weight_block_size [128, 128]): `weight`, `weight_scale_inv` per block
  (a multiplier, despite the name).
NVFP4 weights (E2M1 codes packed two a byte, an E4M3 scale per 16 inputs, a float32 scale per tensor), from
- compressed-tensors (format nvfp4-pack-quantized; weights num_bits 4, type float, strategy tensor_group,
  group_size 16): `weight_packed` uint8 [N, K/2], `weight_scale` [N, K/16], `weight_global_scale` [1] (a
  divisor: w = e2m1 x weight_scale / weight_global_scale);
- ModelOpt (quant_algo NVFP4): `weight` uint8 [N, K/2], `weight_scale` [N, K/16], `weight_scale_2` [] (a
  multiplier).
MXFP4 weights (E2M1 codes packed two a byte, an E8M0 scale 2^(e - 127) per 32 inputs, no tensor scale), from
- compressed-tensors (format mxfp4-pack-quantized; weights num_bits 4, type float, strategy group,
  group_size 32): `weight_packed` uint8 [N, K/2], `weight_scale` uint8 / float8_e8m0fnu [N, K/32];
- gpt-oss (quant_method mxfp4): its experts' `*_blocks` / `*_scales`, which models/gpt_oss.py presents as the
  same per-expert tensors (the rest of the file is float).
Activations are quantized as the checkpoint declares (quant/activations.py; a layer's method takes the
scheme in `take_input_quant`: on the CPU its input is rounded to the format before the float32 product):
- compressed-tensors `input_activations`: FP8 static per tensor (`input_scale`, a multiplier), dynamic per
  token, dynamic per token group; NVFP4 `dynamic: local` blocks of 16 under `input_global_scale` (a divisor,
  448 x 6 / amax); MXFP4 dynamic blocks of 32; none: weight-only;
- ModelOpt FP8 and NVFP4 (their recipes quantize inputs): `input_scale` (a multiplier) per layer;
- DeepSeek fp8: `activation_scheme` dynamic (per token group of 128 with blocks, else per token) or static.
A fused layer's shards (qkv, gate/up) read one input: where their static scales differ the largest is used
(no shard's calibrated range is clipped). Loaded with another method (`quantization=...` naming a different
format), the weights are dequantized and requantized and the activations stay float32.
Every scale's shape is checked against its weight's and the declared strategy (check_scale_shape), and a
per-group / per-block activation scheme against each layer's input width, at load. Anything else (integer
schemes, mixed weight / activation formats, ...) is an error that names it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from tokenmill.quant.activations import ActivationScheme, InputQuant

SUPPORTED = ("FP8 E4M3 weights per tensor, per channel, in 128x128 blocks or in groups of 16, 32 or a multiple "
             "of 64 inputs; NVFP4 weights (groups of 16); "
             "MXFP4 weights (groups of 32, compressed-tensors; gpt-oss's experts)")
NVFP4_GROUP = 16
BLOCK_INPUTS = 128                  # DeepSeek-V3's FP8 blocks, and its activations' token groups
FP4_GROUPS = {"nvfp4": NVFP4_GROUP, "mxfp4": 32}     # FP4 strategy -> inputs per block scale


@dataclass(frozen=True)
class CheckpointQuant:
    vendor: str                    # "compressed-tensors" | "modelopt" | "fp8" (DeepSeek's native format)
    strategy: str                  # "tensor" | "channel" | "block" (FP8) | "nvfp4" | "mxfp4"
    scale_name: str                # "weight_scale" | "weight_scale_inv"
    method: str = "fp8"            # the quant/ method that serves it
    global_scale_name: str = ""    # NVFP4's per-tensor scale: "weight_scale_2" (x) | "weight_global_scale" (/)
    weight_name: str = "weight"    # the codes' tensor: "weight" | "weight_packed" (compressed-tensors FP4)
    activations: ActivationScheme | None = None     # how inputs are quantized; None: weight-only
    input_scale_name: str = ""     # the static activation scale's tensor: "input_scale" (x) | "input_global_scale" (/)
    group_size: int = 0            # FP8 "group": inputs per scale (quant/fp8.py check_group); 0 otherwise

    @property
    def fp4_group(self) -> int:
        """Inputs per block scale of an FP4 format; 0 for FP8."""
        return FP4_GROUPS.get(self.strategy, 0)


@dataclass(frozen=True)
class TensorScaled:
    """NVFP4 block scales of one checkpoint tensor as float32 multipliers (its E4M3 values times
    `tensor_scale`), with that tensor scale (the layer keeps the E4M3 bytes and it)."""
    scales: torch.Tensor
    tensor_scale: float


def scale_tensor(value) -> torch.Tensor:
    """A read_scales value as float32 multipliers."""
    return value.scales if isinstance(value, TensorScaled) else value


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
    if kind == "mxfp4":
        archs = getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "")]
        if not str(archs[0]).lower().startswith(("gptoss", "gpt_oss")):
            raise ValueError(f"quant_method 'mxfp4' is gpt-oss's checkpoint format (experts as *_blocks / "
                             f"*_scales); this checkpoint's architecture is {archs[0]!r}; supported: {SUPPORTED}")
        # models/gpt_oss.py splits the fused *_blocks / *_scales into per-expert weight_packed / weight_scale
        return CheckpointQuant("gpt-oss", "mxfp4", "weight_scale", "mxfp4", "", "weight_packed")
    if kind == "compressed-tensors":
        return _compressed_tensors(qc)
    if kind == "modelopt":
        algo = qc.get("quant_algo")
        if algo == "NVFP4" and int(qc.get("group_size", NVFP4_GROUP)) == NVFP4_GROUP:
            return CheckpointQuant("modelopt", "nvfp4", "weight_scale", "nvfp4", "weight_scale_2",
                                   activations=ActivationScheme("nvfp4", "block", NVFP4_GROUP),
                                   input_scale_name="input_scale")
        if algo != "FP8":
            raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported; supported: {SUPPORTED}")
        return CheckpointQuant("modelopt", "tensor", "weight_scale", activations=ActivationScheme("fp8", "tensor"),
                               input_scale_name="input_scale")
    if kind == "fp8":
        block = qc.get("weight_block_size")
        if qc.get("fmt", "e4m3") != "e4m3" or (block is not None and list(block) != [128, 128]):
            raise ValueError(f"fp8 checkpoint format {qc.get('fmt')!r} with weight_block_size {block} is not "
                             f"supported; supported: {SUPPORTED}")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static") or (block and scheme == "static"):
            raise ValueError(f"fp8 checkpoint activation_scheme {scheme!r} with weight_block_size {block} is not "
                             "supported; supported: dynamic (per token group of 128 with blocks, else per token), "
                             "static (per tensor, without blocks)")
        acts = (ActivationScheme("fp8", "group", BLOCK_INPUTS) if block else
                ActivationScheme("fp8", "token") if scheme == "dynamic" else ActivationScheme("fp8", "tensor"))
        return CheckpointQuant("fp8", "block" if block else "tensor", "weight_scale_inv" if block else "weight_scale",
                               activations=acts, input_scale_name="input_scale" if scheme == "static" else "")
    raise ValueError(f"pre-quantized checkpoint format quant_method={kind!r} is not supported; supported: "
                     f"{SUPPORTED} (compressed-tensors, ModelOpt, DeepSeek fp8)")


def _compressed_tensors(qc: dict) -> CheckpointQuant:
    from tokenmill.quant.fp8 import check_group
    strategies, activations, groups = set(), set(), set()
    for name, group in (qc.get("config_groups") or {}).items():
        activations.add(_ct_activations(name, group.get("input_activations")))
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size")) == (4, "float", "tensor_group",
                                                                                           NVFP4_GROUP):
            strategies.add("nvfp4")
            continue
        if (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("group_size")) == (4, "float", "group",
                                                                                           FP4_GROUPS["mxfp4"]):
            strategies.add("mxfp4")
            continue
        ok = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("tensor", "channel",
                                                                                           "block", "group")
        if w.get("strategy") == "block" and list(w.get("block_structure") or [128, 128]) != [128, 128]:
            ok = False
        if not ok:
            raise ValueError(f"compressed-tensors scheme of {name} (weights num_bits={w.get('num_bits')}, "
                             f"type={w.get('type')}, strategy={w.get('strategy')}) is not supported; "
                             f"supported: {SUPPORTED}")
        if w["strategy"] == "group":
            try:
                groups.add(check_group(w.get("group_size")))
            except ValueError as e:
                raise ValueError(f"compressed-tensors scheme of {name}: {e}") from None
        strategies.add(w["strategy"])
    if len(strategies) != 1 or len(groups) > 1:
        raise ValueError("compressed-tensors: one weight strategy for every group is supported, got "
                         f"{sorted(strategies)}" + (f" with group sizes {sorted(groups)}" if len(groups) > 1 else ""))
    if len(activations) != 1:
        raise ValueError("compressed-tensors: one activation scheme for every group is supported, got "
                         + ", ".join(sorted("weight-only" if a is None else a.describe() for a in activations)))
    acts = activations.pop()
    strategy = strategies.pop()
    weight_format = strategy if strategy in FP4_GROUPS else "fp8"
    if acts is not None and acts.format != weight_format:
        raise ValueError(f"compressed-tensors: {weight_format} weights with {acts.describe()} are not supported; "
                         "supported: activations in the weights' format, or none (weight-only)")
    input_scale = "" if acts is None or not acts.needs_static_scale else (
        "input_global_scale" if acts.format == "nvfp4" else "input_scale")
    if strategy == "nvfp4":
        return CheckpointQuant("compressed-tensors", "nvfp4", "weight_scale", "nvfp4", "weight_global_scale",
                               "weight_packed", acts, input_scale)
    if strategy == "mxfp4":
        return CheckpointQuant("compressed-tensors", "mxfp4", "weight_scale", "mxfp4", "", "weight_packed", acts)
    return CheckpointQuant("compressed-tensors", strategy, "weight_scale", activations=acts,
                           input_scale_name=input_scale, group_size=groups.pop() if groups else 0)


def _ct_activations(name: str, a: dict | None) -> ActivationScheme | None:
    """A compressed-tensors group's `input_activations` as a scheme (None: weight-only)."""
    if not a:
        return None
    key = (a.get("num_bits"), a.get("type"), a.get("strategy"), a.get("dynamic"))
    if key == (8, "float", "tensor", False):
        return ActivationScheme("fp8", "tensor")
    if key == (8, "float", "token", True):
        return ActivationScheme("fp8", "token")
    if key == (8, "float", "group", True) and a.get("group_size"):
        return ActivationScheme("fp8", "group", int(a["group_size"]))
    if key == (4, "float", "tensor_group", "local") and a.get("group_size") == NVFP4_GROUP:
        return ActivationScheme("nvfp4", "block", NVFP4_GROUP)
    if key == (4, "float", "group", True) and a.get("group_size") == FP4_GROUPS["mxfp4"]:
        return ActivationScheme("mxfp4", "block", FP4_GROUPS["mxfp4"])
    raise ValueError(f"compressed-tensors input_activations of {name} (num_bits={a.get('num_bits')}, "
                     f"type={a.get('type')}, strategy={a.get('strategy')}, dynamic={a.get('dynamic')}, "
                     f"group_size={a.get('group_size')}) are not supported; supported: FP8 static per tensor, "
                     "dynamic per token or per token group; NVFP4 dynamic local (groups of 16); MXFP4 dynamic "
                     "(groups of 32); or none (weight-only)")


def read_scales(iter_weights, fmt: CheckpointQuant) -> dict[str, torch.Tensor | TensorScaled]:
    """The checkpoint's weight scales by module name, as float32 multipliers (NVFP4: TensorScaled, with the
    tensor scale; scale_tensor gives the multipliers). One pass over the lazy checkpoint: only they are read
    (and the weights' shapes, which each scale's shape is checked against: check_scale_shape)."""
    from tokenmill.loaders.lazy import read_part
    suffix, tensor_suffix = "." + fmt.scale_name, "." + (fmt.global_scale_name or fmt.scale_name)
    weight_suffix = "." + fmt.weight_name
    scales, tensor_scales, weight_shapes = {}, {}, {}
    for name, t in iter_weights():
        if name.endswith(suffix):
            scales[name[: -len(suffix)]] = _scale_values(read_part(t, slice(None), slice(None)), fmt)
        elif fmt.global_scale_name and name.endswith(tensor_suffix):
            tensor_scales[name[: -len(tensor_suffix)]] = read_part(t, slice(None), slice(None)).float().reshape(())
        elif name.endswith(weight_suffix):
            weight_shapes[name[: -len(weight_suffix)]] = tuple(t.shape)
    for module, scale in scales.items():
        if module in weight_shapes:          # a scale without its weight: named where the codes are missed
            check_scale_shape(module, tuple(scale.shape), weight_shapes[module], fmt)
    if not fmt.global_scale_name:
        return scales
    missing = sorted(set(scales) - set(tensor_scales))
    if missing:
        raise ValueError(f"NVFP4 checkpoint: {missing[0]} has {fmt.scale_name} but no {fmt.global_scale_name}")
    divide = fmt.global_scale_name == "weight_global_scale"      # compressed-tensors stores the reciprocal
    return {m: TensorScaled(s / tensor_scales[m], float(1 / tensor_scales[m])) if divide else
            TensorScaled(s * tensor_scales[m], float(tensor_scales[m])) for m, s in scales.items()}


def check_scale_shape(module: str, scale_shape: tuple, weight_shape: tuple, fmt: CheckpointQuant) -> None:
    """ValueError naming `module`'s scale tensor unless its shape is what the format declares for the weight's:
    FP8 per tensor [] / [1], per channel [N, 1] / [N], blocks [ceil(N / 128), ceil(K / 128)], groups
    [N, K / group]; FP4 [N, K / group] (the weight's codes packed two a byte: [N, K / 2])."""
    from tokenmill.quant.fp8 import scale_shapes
    name = f"{module}.{fmt.scale_name}"
    if len(weight_shape) != 2:
        raise ValueError(f"{module}.{fmt.weight_name} has shape {weight_shape}, expected a matrix [N, K]")
    n, k = weight_shape[0], weight_shape[1] * (2 if fmt.fp4_group else 1)
    if fmt.fp4_group:
        expected = ((n, k // fmt.fp4_group),) if k % fmt.fp4_group == 0 else ()
        declared = f"{fmt.strategy} scales per {fmt.fp4_group} inputs"
    else:
        expected = scale_shapes(fmt.strategy, n, k, fmt.group_size)
        declared = f"FP8 {fmt.strategy} scales" + (f" per {fmt.group_size} inputs" if fmt.group_size else "")
    if tuple(scale_shape) not in expected:
        want = " or ".join(str(list(e)) for e in expected) or \
            f"none: K = {k} is not a multiple of {fmt.fp4_group or fmt.group_size}"
        raise ValueError(f"{name} has shape {list(scale_shape)}, expected {want} ({fmt.vendor} {declared} of a "
                         f"weight [{n}, {k}])")


def _scale_values(scale: torch.Tensor, fmt: CheckpointQuant) -> torch.Tensor:
    """A scale tensor as float32 multipliers: MXFP4's E8M0 bytes (uint8 or float8_e8m0fnu) are exponents."""
    if fmt.strategy != "mxfp4":
        return scale.float()
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise ValueError(f"an MXFP4 weight_scale must be E8M0 (uint8 or float8_e8m0fnu), got {scale.dtype}")
    from tokenmill.quant.fp4 import e8m0_to_float
    exponents = scale.view(torch.uint8)
    if (exponents == 255).any():
        raise ValueError("an MXFP4 weight_scale holds E8M0 255, which is NaN")
    return e8m0_to_float(exponents)


def dequantized_weights(iter_weights, fmt: CheckpointQuant, scales: dict[str, torch.Tensor], take_codes=None):
    """(checkpoint name, tensor) pairs, each FP8 / FP4 weight dequantized by its scale as it is read (one at a
    time), the scale tensors themselves left out. take_codes(module, tensor) -> bool, when given, is offered
    every quantized weight first: True means it kept the codes as they are (then nothing is yielded)."""
    from tokenmill.loaders.lazy import read_part
    from tokenmill.quant.fp8 import BLOCK, dequantize, expand_scale
    skipped = ("." + fmt.scale_name, ".input_scale", ".weight_scale_2", ".weight_global_scale", ".input_global_scale")
    suffix = "." + fmt.weight_name
    for name, t in iter_weights():
        if name.endswith(skipped):
            continue
        module = name[: -len(suffix)] if name.endswith(suffix) else None
        if module not in scales:
            yield name, t
            continue
        if take_codes is not None and take_codes(module, t):
            continue
        q = read_part(t, slice(None), slice(None))
        if fmt.fp4_group:
            yield module + ".weight", _dequantize_fp4(name, q, scale_tensor(scales[module]), fmt)
            continue
        if q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: a {fmt.vendor} FP8 weight must be float8_e4m3fn, got {q.dtype}")
        kblock = BLOCK if fmt.strategy == "block" else fmt.group_size or q.shape[1]
        full = expand_scale(q.float(), fmt.strategy, scales[module], kblock, f"{module}.{fmt.scale_name}")
        yield name, dequantize(q, full, kblock)


def _dequantize_fp4(name: str, packed: torch.Tensor, scales: torch.Tensor, fmt: CheckpointQuant) -> torch.Tensor:
    from tokenmill.quant.fp4 import dequantize
    group = fmt.fp4_group
    if packed.dtype != torch.uint8 or packed.dim() != 2 or scales.shape != (packed.shape[0], packed.shape[1] * 2 // group):
        raise ValueError(f"{name}: an {fmt.strategy.upper()} weight must be uint8 [N, K/2] with scales "
                         f"[N, K/{group}]; got {packed.dtype} {tuple(packed.shape)} and scales {tuple(scales.shape)}")
    return dequantize(packed, scales, group)


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
        layer_name, shard = _linear_target(model.checkpoint_name(ckpt_module + ".weight"), model.STACKED)
        layer = modules.get(layer_name)
        if not isinstance(layer, Linear):
            continue
        rows, cols = layer.checkpoint_slice(shard)
        part = scale
        if fmt.fp4_group or fmt.group_size:      # [N, K / group]: this rank's rows, its columns' groups
            part = _group_columns(layer_name, scale_tensor(scale)[rows], cols, fmt.fp4_group or fmt.group_size)
        if fmt.fp4_group:
            tensor_scale = scale.tensor_scale if isinstance(scale, TensorScaled) else None
            target_rows = layer.shard_rows(shard) if shard is not None else slice(0, layer.out_features)
            layer.checkpoint_fp4 = getattr(layer, "checkpoint_fp4", []) + [(target_rows, part, tensor_scale)]
            done.add(layer_name)
            continue
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
    for layer_name in done:
        _check_rows_covered(modules[layer_name], layer_name)
    return done


def _group_columns(layer_name: str, scale: torch.Tensor, cols: slice, group: int) -> torch.Tensor:
    """Scales [n, K / group] of this rank's columns `cols` (which must start and end on group boundaries)."""
    c0, c1 = cols.start or 0, cols.stop
    if c0 % group or (c1 is not None and c1 % group):
        raise ValueError(f"{layer_name}: this rank's columns do not start on a {group}-group boundary")
    return scale[:, c0 // group: None if c1 is None else c1 // group]


def read_input_scales(iter_weights, fmt: CheckpointQuant) -> dict[str, float]:
    """The checkpoint's static activation scales by module name, as float32 multipliers (compressed-tensors'
    `input_global_scale` is a divisor); empty when its scheme has none."""
    from tokenmill.loaders.lazy import read_part
    if not fmt.input_scale_name:
        return {}
    suffix, out = "." + fmt.input_scale_name, {}
    for name, t in iter_weights():
        if name.endswith(suffix):
            value = read_part(t, slice(None), slice(None)).float().reshape(-1)
            if value.numel() != 1 or not bool(value[0] > 0) or not bool(torch.isfinite(value[0])):
                raise ValueError(f"{name}: a static activation scale must be one positive finite value, got "
                                 f"{value.tolist()[:4]}")
            out[name[: -len(suffix)]] = float(1 / value[0]) if fmt.input_scale_name == "input_global_scale" \
                else float(value[0])
    return out


def attach_input_quant(model, layers: set[str], input_scales: dict[str, float], fmt: CheckpointQuant) -> None:
    """Give each quantized layer (`layers`, after its method is set) the checkpoint's activation scheme through
    its method's take_input_quant, with its static scale: the largest of its shards' (they read one input)."""
    if fmt.activations is None:
        return
    from tokenmill.layers.quantize import _linear_target
    modules = dict(model.named_modules())
    by_layer: dict[str, list[float]] = {}
    for ckpt_module, scale in input_scales.items():
        layer_name, _ = _linear_target(model.checkpoint_name(ckpt_module + ".weight"), model.STACKED)
        by_layer.setdefault(layer_name, []).append(scale)
    for layer_name in sorted(layers):
        scales = by_layer.get(layer_name)
        if fmt.activations.needs_static_scale and not scales:
            raise ValueError(f"{layer_name}: the checkpoint declares {fmt.activations.describe()} but gives this "
                             f"layer no {fmt.input_scale_name}")
        layer = modules[layer_name]
        _check_input_width(layer, layer_name, fmt.activations)
        layer.quant_method.take_input_quant(layer, InputQuant(fmt.activations, max(scales) if scales else None))


def _check_input_width(layer, layer_name: str, scheme: ActivationScheme) -> None:
    """Per-group and per-block schemes scale each row's inputs in runs of scheme.group: a layer's input (this
    rank's part of it) must be a whole number of runs, or every request would fail."""
    if scheme.granularity in ("group", "block") and layer.in_features % scheme.group:
        raise ValueError(f"{layer_name}: the checkpoint declares {scheme.describe()}, which needs the layer's "
                         f"input width (in_features {layer.in_features}) to be a multiple of {scheme.group}")


def checkpoint_parts(layer) -> list:
    """The shards attach_scales gave a layer: (rows in the layer, ...) for FP8 or FP4."""
    return getattr(layer, "checkpoint_fp8", None) or getattr(layer, "checkpoint_fp4", None) or []


def _check_rows_covered(layer, layer_name: str) -> None:
    rows = sorted((r.start, r.stop) for r, *_ in checkpoint_parts(layer))
    covered = 0
    for start, stop in rows:
        if start != covered:
            break
        covered = stop
    if covered != layer.out_features:
        raise ValueError(f"{layer_name}: the checkpoint quantizes only some of this fused layer's parts (rows "
                         f"{rows} of {layer.out_features}); a fused layer with a part kept in float is not supported")
