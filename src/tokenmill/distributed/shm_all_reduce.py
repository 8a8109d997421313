"""All-reduce of float32 CPU tensors between the tensor-parallel ranks of one machine through shared memory.

gloo's all-reduce crosses a TCP socket and wakes an I/O thread in each process: on a small CPU host, with
the ranks and their I/O threads sharing few cores, one costs a millisecond or more, and tensor parallelism
runs two per layer. Here each rank copies its tensor into its slot of a mapped file and publishes a step
number; every rank waits (spinning, then yielding the core) until all ranks have published, and sums the
slots in rank order, so every rank holds the same bits.

Layout of the file (/dev/shm, unlinked once every rank has mapped it): one int64 step counter per rank, 64
bytes apart, then two halves x ranks x `capacity` bytes. Step s uses half s % 2: a rank writes half h
again at step s + 2 only after every rank published s + 1, which each does after summing step s, so no
slot is overwritten while it is read. Ordering relies on x86's total store order (stores become visible
in program order), so the group uses it only on x86-64 hosts, and only when every rank could map the file
(ranks on other hosts fall back to gloo together). Tensors larger than `capacity` take gloo's path.

A rank that times out waiting for the others can no longer tell which all-reduce they are at: its
instance refuses every later call (raises), and it publishes ABANDONED as its step, so a peer that
arrives later raises too instead of summing slots from different all-reduces.
"""
from __future__ import annotations

import os
import platform
import time
import uuid

import torch

CAPACITY_BYTES = 8 << 20         # per rank and half: a prefill chunk of 2048 tokens x 1024 float32 values
_COUNTER_STRIDE = 8              # int64s between two ranks' counters (64 bytes: one cache line each)
_SPINS_BEFORE_YIELD = 256
ABANDONED = 2**62                # a rank's step counter once it gave up waiting: the group is out of step


class ShmAllReduce:
    def __init__(self, path: str, rank: int, size: int, capacity: int = CAPACITY_BYTES,
                 timeout_s: float = 60.0) -> None:
        self.rank, self.size, self.capacity, self.timeout_s = rank, size, capacity, timeout_s
        header = size * _COUNTER_STRIDE * 8
        raw = torch.from_file(path, shared=True, size=header + 2 * size * capacity, dtype=torch.uint8)
        self.counters = raw[:header].view(torch.int64)[::_COUNTER_STRIDE]          # [size]
        self.slots = raw[header:].view(torch.float32).view(2, size, capacity // 4)  # [half, rank, values]
        self.step = int(self.counters[rank])
        self.broken: str | None = None       # why this rank's all-reduces are no longer in step with the others'

    def all_reduce(self, x: torch.Tensor) -> bool:
        """x <- the sum of x over the ranks, in place; False (x untouched) when x is not a contiguous float32
        CPU tensor of at most `capacity` bytes (the caller then uses gloo). Raises RuntimeError, for every
        tensor, once a rank of the group timed out (this one or another): the ranks' steps may not match."""
        if self.broken is not None:                          # gloo's path would be out of step as well
            raise RuntimeError(f"the shared-memory all-reduce is out of step and refuses further use: {self.broken}")
        n = x.numel()
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous() or 4 * n > self.capacity:
            return False
        self.step += 1
        half = self.slots[self.step % 2]
        half[self.rank, :n].copy_(x.view(-1))
        self.counters[self.rank] = self.step                 # published after the copy (x86 store order)
        self._wait_all()
        flat = x.view(-1)
        flat.copy_(half[0, :n])
        for r in range(1, self.size):
            flat.add_(half[r, :n])
        return True

    def _wait_all(self) -> None:
        spins, deadline = 0, None
        for r in range(self.size):
            while (published := int(self.counters[r])) < self.step:
                spins += 1
                if spins % _SPINS_BEFORE_YIELD == 0:
                    os.sched_yield()
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        self._abandon(f"tensor-parallel rank {r} did not reach all-reduce step {self.step} "
                                      f"within {self.timeout_s:g} s (it died or hangs)")
            if published == ABANDONED:
                self._abandon(f"tensor-parallel rank {r} gave up on an all-reduce (timed out): the ranks are "
                              f"out of step")

    def _abandon(self, why: str):
        """This rank leaves the group for good: later calls here raise, and peers see ABANDONED and raise."""
        self.broken = why
        self.counters[self.rank] = ABANDONED
        raise RuntimeError(why)


def shm_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def create_group_shm(rank: int, size: int, group, capacity: int = CAPACITY_BYTES,
                     timeout_s: float = 60.0) -> ShmAllReduce | None:
    """Collective over the gloo `group`: rank 0 creates the file and tells the others its path; every rank
    maps it; it is used only if all ranks could (None on every rank otherwise)."""
    import torch.distributed as dist
    path = [None]
    if rank == 0 and shm_supported():
        path[0] = f"/dev/shm/tokenmill-tp-{uuid.uuid4().hex}"
        with open(path[0], "wb") as f:
            f.truncate(size * _COUNTER_STRIDE * 8 + 2 * size * capacity)
    try:
        dist.broadcast_object_list(path, src=0, group=group)
        shm = _map_if_here(path[0], rank, size, capacity, timeout_s)
        ok = torch.tensor([1 if shm is not None else 0], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    finally:
        if rank == 0 and path[0] is not None:
            os.unlink(path[0])             # every rank has it mapped, or none uses it (a collective failed)
    return shm if int(ok) == 1 else None


def _map_if_here(path: str | None, rank: int, size: int, capacity: int, timeout_s: float) -> ShmAllReduce | None:
    if path is None or not shm_supported() or not os.path.exists(path):     # not there: another host
        return None
    try:
        return ShmAllReduce(path, rank, size, capacity, timeout_s)
    except (OSError, RuntimeError):
        return None
