"""Executors: how the engine core drives its model. `uni` runs it in this process; `mp` in one worker
process per tensor-parallel rank on this machine (the step reaches them as a compact delta,
messages.py); `ray` in Ray actors placed by a cluster, for ranks on several machines. Chosen by ParallelConfig.distributed_executor_backend."""
from __future__ import annotations

import importlib

from tokenmill.executor.base import Executor, ExecutorFailed

EXECUTORS = {"uni": "tokenmill.executor.uni:UniExecutor",          # name -> module:class, imported lazily
             "mp": "tokenmill.executor.mp:MultiprocExecutor",
             "ray": "tokenmill.executor.ray_executor:RayExecutor"}


def make_executor(config, weights, platform) -> Executor:
    name = config.parallel.distributed_executor_backend
    if name not in EXECUTORS:
        raise ValueError(f"unknown distributed_executor_backend {name!r}; expected one of {sorted(EXECUTORS)}")
    module, cls = EXECUTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)(config, weights, platform)


__all__ = ["EXECUTORS", "Executor", "ExecutorFailed", "make_executor"]
