"""Copy (checkpoint name, tensor) pairs into a model's parameters, fused ones included.

Every parameter must be filled exactly once (per shard), every checkpoint tensor must land somewhere,
and shapes must match: each violation is an error that names the tensor."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.loaders.lazy import read_part


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       stacked: dict[str, list[tuple[str, str]]], ignored_suffixes=(), skip=()) -> None:
    """skip: checkpoint names to pass over (a collection, or a predicate name -> bool: e.g. experts another
    expert-parallel rank holds)."""
    skipped = skip if callable(skip) else skip.__contains__
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    expected = _expected_pieces(params, modules, stacked)
    loaded: set[tuple[str, str | None]] = set()
    for name, tensor in weights:
        if skipped(name) or name.endswith(tuple(ignored_suffixes)):
            continue
        if _take_kv_scale(modules, name, tensor):
            continue
        param_name, shard = _resolve(name, stacked)
        if param_name not in params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}: the model has no parameter for it")
        _copy_into(params[param_name], modules[param_name.rsplit(".", 1)[0]], shard, name, tensor)
        loaded.add((param_name, shard))
    missing = sorted(f"{p}" + (f" [{s}]" if s else "") for p, s in expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing tensors for: {shown}")


# FP8 KV cache scales a checkpoint may carry per attention layer (vLLM's names; ModelOpt's, exported with
# kv_cache_quant_algo FP8, on k_proj / v_proj; compressed-tensors' output scales of k_proj / v_proj), as
# vLLM's maybe_remap_kv_scale_name maps them: kept on the attention module for kv_cache_dtype="fp8", else unused
_KV_SCALE_NAMES = {"self_attn.k_scale": "k", "self_attn.v_scale": "v",
                   "self_attn.k_proj.k_scale": "k", "self_attn.v_proj.v_scale": "v",
                   "self_attn.k_proj.output_scale": "k", "self_attn.v_proj.output_scale": "v"}


def _take_kv_scale(modules, name: str, tensor) -> bool:
    for suffix, which in _KV_SCALE_NAMES.items():
        if name.endswith("." + suffix):
            attention = modules.get(name[: -len(suffix)] + "self_attn")
            if attention is None:
                raise ValueError(f"checkpoint tensor {name!r}: no attention layer {name[: -len(suffix)]}self_attn")
            from tokenmill.loaders.lazy import read_part
            value = read_part(tensor, slice(None), slice(None)).float().reshape(-1)
            if value.numel() != 1:
                raise ValueError(f"checkpoint tensor {name!r} has {value.numel()} values; per-layer KV cache "
                                 "scales (one value) are supported")
            attention.checkpoint_kv_scales = {**getattr(attention, "checkpoint_kv_scales", {}), which: value}
            return True
    return False


def _resolve(name: str, stacked) -> tuple[str, str | None]:
    for fused, parts in stacked.items():
        for part, shard in parts:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _expected_pieces(params, modules, stacked) -> set[tuple[str, str | None]]:
    fused_names = set(stacked)
    out = set()
    for pname in params:
        owner = pname.rsplit(".", 1)[0]
        leaf = owner.rsplit(".", 1)[-1]
        if leaf in fused_names:
            out.update((pname, shard) for _, shard in stacked[leaf])
        else:
            out.add((pname, None))
    return out


def _copy_into(param: torch.Tensor, module: nn.Module, shard, ckpt_name: str, value) -> None:
    """value: a tensor or a loaders/lazy.py checkpoint tensor; only the module's slice of it is read (a
    tensor-parallel rank's rows or columns, checkpoint_slice) and checked against the parameter."""
    target = param.data
    if shard is not None:
        target = target[module.shard_rows(shard)]
    part = getattr(module, "checkpoint_slice", None)
    rows, cols = part(shard) if part is not None else (slice(None), slice(None))
    full = tuple(value.shape)
    tensor = read_part(value, rows, cols) if (rows, cols) != (slice(None), slice(None)) or \
        not isinstance(value, torch.Tensor) else value
    if tuple(target.shape) != tuple(tensor.shape):
        held = "" if tuple(tensor.shape) == full else f" (this rank's part of {full})"
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}{held}, "
                         f"expected {tuple(target.shape)}")
    target.copy_(tensor.to(target.dtype))
