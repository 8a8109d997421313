"""The collectives of tensor parallelism, the only calls to torch.distributed's data movement. Each is
the identity in a group of one."""
from __future__ import annotations

import torch

from tokenmill.distributed.parallel_state import tensor_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the group's ranks, in place (through shared memory where the group has it and x
    fits, else the process group's all-reduce)."""
    tp = tensor_parallel()
    if tp.size > 1 and not (tp.shm is not None and tp.shm.all_reduce(x)):
        import torch.distributed as dist
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """[..., sizes[rank]] on each rank -> [..., sum(sizes)] on every rank, ranks in order (sizes may differ)."""
    tp = tensor_parallel()
    if tp.size == 1:
        return x
    import torch.distributed as dist
    width = max(sizes)
    padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(parts, padded.contiguous(), group=tp.group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)



def exchange_counts(send_counts: list[int], group, device: torch.device) -> list[int]:
    """Each rank tells every other how many rows it will send it: send_counts[p] rows to rank p -> the
    rows each rank will send here, in rank order (one all_to_all_single)."""
    import torch.distributed as dist
    counts_in = torch.empty(len(send_counts), dtype=torch.long, device=device)       # NCCL: device tensors
    dist.all_to_all_single(counts_in, torch.tensor(send_counts, dtype=torch.long, device=device), group=group)
    return counts_in.tolist()


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """Rows x[sum(send_counts[:p]) : ... + send_counts[p]] go to rank p; returns the rows every rank sent
    here, in rank order: [sum(recv_counts), ...]. With the counts swapped it sends results back."""
    import torch.distributed as dist
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out

def all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """[sizes[rank], ...] on each rank -> [sum(sizes), ...] on every rank, ranks in order."""
    import torch.distributed as dist
    most = max(sizes)
    padded = x if x.shape[0] == most else torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])
