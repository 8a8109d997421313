"""Token embedding and the logits gather, vocabulary-parallel across tensor-parallel ranks: rank r holds
the rows of a run of token ids (an even split), looks up the ids in its run, and the ranks' results are
summed (each id's row comes from exactly one rank). A head of the same split (ColumnParallelLinear over
the vocabulary, or the embedding itself when tied) gives each rank its run of the logits; gather_logits
joins them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.communication import all_gather_last_dim, all_reduce
from tokenmill.distributed.parallel_state import split_evenly, tensor_parallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        tp = tensor_parallel()
        self.vocab_size = vocab_size
        self.first, self.count = split_evenly(vocab_size, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.count, hidden_size, dtype=dtype), requires_grad=False)
        self.parallel = tp.size > 1

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        return slice(self.first, self.first + self.count), slice(None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, hidden]."""
        if not self.parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        out = F.embedding(local.clamp(0, self.count - 1), self.weight) * mine.unsqueeze(1).to(self.weight.dtype)
        return all_reduce(out)


def vocab_runs(vocab_size: int) -> list[int]:
    """Each rank's number of vocabulary rows, in rank order."""
    size = tensor_parallel().size
    return [split_evenly(vocab_size, size, r)[1] for r in range(size)]


def gather_logits(local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, this rank's vocabulary run] -> [R, vocab_size] on every rank."""
    return all_gather_last_dim(local, vocab_runs(vocab_size))
