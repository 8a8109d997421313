"""This process's place in the tensor-parallel group: rank and size, set once per worker process before
its model is built (layers read them at build time, as they read their kernels from the platform).

Without a group (one process, TP=1) every layer is whole: rank 0 of 1."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    group: object | None = None          # torch.distributed ProcessGroup; None when size == 1


_TP = TensorParallelGroup(0, 1)


def tensor_parallel() -> TensorParallelGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str,
                         timeout_s: float = 60.0) -> TensorParallelGroup:
    """Join the group of `size` ranks (gloo on the CPU, NCCL on CUDA) that meet at `init_method`
    (e.g. tcp://127.0.0.1:PORT). A collective that waits longer than `timeout_s` (a rank died) raises."""
    global _TP
    if size > 1:
        import torch.distributed as dist
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _TP = TensorParallelGroup(rank, size, dist.group.WORLD)
    else:
        _TP = TensorParallelGroup(0, 1)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.size > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    _TP = TensorParallelGroup(0, 1)


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` when `total` units are split into `parts` runs as evenly as
    possible, the first total % parts runs one unit longer."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
