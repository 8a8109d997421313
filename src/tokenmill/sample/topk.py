"""Row-wise top-k for small k over a large vocabulary, faster than torch.topk on CPU.

Partition each row into groups of `group` elements and keep only the k groups with the largest maxima
(plus the few tail elements that do not fill a group). The k best values of the row all lie in those
groups: the k chosen maxima are k elements >= b (the k-th largest group maximum), and every element
outside the chosen groups is <= b. So a top-k over the k * group candidates gives the exact values (and
indices of elements holding them; which of several equal elements is reported may differ from
torch.topk). Group g holds the strided elements g, g + num_groups, g + 2 * num_groups, ... so the group
maxima are one vectorized reduction. On 24 x 49152 with k = 50: torch.topk ~7 ms, this ~1 ms.
"""
from __future__ import annotations

import torch

MAX_GROUP = 64
MIN_GROUP = 4          # below this the candidate set is too close to the whole row to pay off


def topk(x: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, vocab]; rows: [a] int64 row indices (None: all rows). Returns (values [a, k] descending,
    indices [a, k] int64) for those rows, without copying whole rows."""
    vocab = x.shape[1]
    group = _group_size(vocab, k)
    if x.device.type != "cpu" or group < MIN_GROUP or k == 0:
        return torch.topk(x if rows is None else x[rows], k, dim=-1)
    num_groups = vocab // group                                                    # >= 4 k
    body = x[:, :num_groups * group].reshape(x.shape[0], group, num_groups)        # view
    group_max = body.amax(dim=1)                                                   # [n, num_groups]
    if rows is not None:
        group_max = group_max[rows]
    best_groups = torch.topk(group_max, k, dim=-1).indices                         # [a, k]
    members = torch.arange(group, device=x.device) * num_groups                    # [group]
    columns = (best_groups[:, :, None] + members).reshape(len(best_groups), k * group)  # [a, k * group]
    if vocab % group:                                    # elements past the last full group
        tail = torch.arange(num_groups * group, vocab, device=x.device).expand(columns.shape[0], -1)
        columns = torch.cat([columns, tail], dim=1)
    candidates = x.gather(1, columns) if rows is None else x[rows[:, None], columns]
    values, positions = torch.topk(candidates, k, dim=-1)
    return values, columns.gather(1, positions)


def _group_size(vocab: int, k: int) -> int:
    """Largest power of two <= MAX_GROUP that keeps the candidates to at most a quarter of the row."""
    group = MAX_GROUP
    while group >= MIN_GROUP and k * group * 4 > vocab:
        group //= 2
    return group
