"""The collectives of tensor parallelism, the only calls to torch.distributed's data movement. Each is
the identity in a group of one."""
from __future__ import annotations

import torch

from tokenmill.distributed.parallel_state import tensor_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the group's ranks, in place."""
    tp = tensor_parallel()
    if tp.size > 1:
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
