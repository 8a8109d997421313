"""Held drafter rows (spec/drafter.py take_rows): what runs when, and that positions stay contiguous."""
from __future__ import annotations

import torch

from tokenmill.core.messages import SchedulerOutput
from tokenmill.spec.drafter import Drafter


def _rows(n: int, first: float = 0.0) -> torch.Tensor:
    return torch.arange(first, first + n).unsqueeze(1).repeat(1, 2)


def test_rows_are_held_until_drafts_or_a_full_chunk():
    d = Drafter(torch.device("cpu"))
    assert d.take_rows("a", 10, [1], _rows(1, 10), drafts_now=False) is None
    assert d.take_rows("a", 11, [2], _rows(1, 11), drafts_now=False) is None
    start, ids, hidden = d.take_rows("a", 12, [3], _rows(1, 12), drafts_now=True)
    assert (start, ids) == (10, [1, 2, 3]) and hidden[:, 0].tolist() == [10, 11, 12]
    assert "a" not in d.pending
    d.upkeep_chunk = 3
    assert d.take_rows("b", 0, [1, 2], None, drafts_now=False) is None
    assert d.take_rows("b", 2, [3], None, drafts_now=False) == (0, [1, 2, 3], None)   # a full chunk runs


def test_rows_the_step_rewrites_replace_held_ones_and_a_gap_drops_them():
    d = Drafter(torch.device("cpu"))
    d.take_rows("a", 0, [1, 2, 3], _rows(3), drafts_now=False)
    start, ids, hidden = d.take_rows("a", 2, [7, 8], _rows(2, 20), drafts_now=True)  # position 2 again
    assert (start, ids) == (0, [1, 2, 7, 8]) and hidden[:, 0].tolist() == [0, 1, 20, 21]
    d.take_rows("a", 0, [1, 2], None, drafts_now=False)
    assert d.take_rows("a", 5, [9], None, drafts_now=True) == (5, [9], None)        # stale: recomputed later


def test_finished_and_preempted_requests_drop_their_rows():
    d = Drafter(torch.device("cpu"))
    for rid in "abc":
        d.take_rows(rid, 0, [1], None, drafts_now=False)
    d.forget(SchedulerOutput([], finished_request_ids=["a"], preempted_request_ids=["b"]))
    assert set(d.pending) == {"c"}
