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
    shm: object | None = None            # shm_all_reduce.ShmAllReduce: the CPU ranks of one x86 host


_TP = TensorParallelGroup(0, 1)


def tensor_parallel() -> TensorParallelGroup:
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str,
                         timeout_s: float = 60.0) -> TensorParallelGroup:
    """Join the group of `size` ranks (gloo on the CPU, NCCL on CUDA) that meet at `init_method`
    (e.g. tcp://127.0.0.1:PORT). A collective that waits longer than `timeout_s` (a rank died) raises. CPU
    ranks that all sit on one x86 host sum through shared memory (shm_all_reduce.py), gloo otherwise."""
    global _TP
    if size > 1:
        import torch.distributed as dist
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        shm = None
        if backend == "gloo":                # gloo's all-reduce costs a millisecond on a small host
            from tokenmill.distributed.shm_all_reduce import create_group_shm
            shm = create_group_shm(rank, size, dist.group.WORLD, timeout_s=timeout_s)
        _TP = TensorParallelGroup(rank, size, dist.group.WORLD, shm)
    else:
        _TP = TensorParallelGroup(0, 1)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP, _EP
    _EP = ExpertParallelGroup(0, 1)
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


@dataclass(frozen=True)
class ExpertParallelGroup:
    """The ranks MoE layers split their experts over: the tensor-parallel group's ranks when expert
    parallelism is on (attention stays tensor-parallel across them), else a group of one."""
    rank: int
    size: int
    group: object | None = None


_EP = ExpertParallelGroup(0, 1)


def expert_parallel() -> ExpertParallelGroup:
    return _EP


def set_expert_parallel(enabled: bool) -> ExpertParallelGroup:
    """After init_tensor_parallel: MoE layers built from now on shard experts over its ranks (enabled) or
    split every expert's intermediate dimension across them (not)."""
    global _EP
    tp = _TP
    _EP = ExpertParallelGroup(tp.rank, tp.size, tp.group) if enabled and tp.size > 1 else ExpertParallelGroup(0, 1)
    return _EP
