"""Platforms: one per device kind, chosen once per engine from `device` (EngineArgs).

    platform = resolve_platform("auto")       # CUDA when torch sees a GPU, else the CPU
    with building(platform, dtype):           # layers built inside ask op_kernels() for their kernels,
        model = ModelClass(cfg)               # and their tensors are created on platform.device

Layers built outside a `building` block (unit tests) get the CPU's float32 kernels.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib

import torch

from tokenmill.platforms.base import KVMemoryRequest, OpKernels, Platform

PLATFORMS = {"cpu": "tokenmill.platforms.cpu:CPUPlatform",          # name -> module:class, imported lazily
             "cuda": "tokenmill.platforms.cuda:CUDAPlatform"}

_BUILDING: contextvars.ContextVar = contextvars.ContextVar("tokenmill_building", default=None)


def resolve_platform(device: str = "auto") -> Platform:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> the Platform for it; ValueError naming what was asked and
    what this machine has when it is not there."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string ('auto', 'cpu', 'cuda' or 'cuda:N'), got {device!r}")
    kind, _, index = device.partition(":")
    if device == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in PLATFORMS or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"unknown device {device!r}; expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA GPU on this machine "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use device='cpu'")
        if index and int(index) >= count:
            raise ValueError(f"device {device!r} was asked for, but this machine has {count} CUDA GPU(s): "
                             f"cuda:0..cuda:{count - 1}")
        torch_device = torch.device("cuda", int(index or 0))
    else:
        torch_device = torch.device("cpu")
    module, cls = PLATFORMS[kind].split(":")
    return getattr(importlib.import_module(module), cls)(torch_device)


@contextlib.contextmanager
def building(platform: Platform, dtype: torch.dtype):
    """Layers built inside get `platform`'s kernels for `dtype`, and tensors are made on its device."""
    token = _BUILDING.set((platform, dtype))
    try:
        with torch.device(platform.device):
            yield
    finally:
        _BUILDING.reset(token)


def op_kernels() -> OpKernels:
    """The kernels for the layer being built (see `building`)."""
    target = _BUILDING.get()
    if target is None:
        from tokenmill.platforms.cpu import CPUPlatform
        return CPUPlatform(torch.device("cpu")).op_kernels(torch.float32)
    platform, dtype = target
    return platform.op_kernels(dtype)


__all__ = ["KVMemoryRequest", "OpKernels", "Platform", "building", "op_kernels", "resolve_platform"]
