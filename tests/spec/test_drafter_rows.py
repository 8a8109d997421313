"""Held drafter rows (spec/drafter.py): what runs when, that positions stay contiguous, and that no held row
outlives the moment another request may read the blocks it belongs to."""
from __future__ import annotations

import torch

from tokenmill.core.messages import ScheduledRequest, SchedulerOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.drafter import Drafter

TABLE = [7, 8, 9]                          # a block table


class RecordingDrafter(Drafter):
    """Records the held rows it is asked to run: (start, ids, block table) each."""

    def __init__(self, prefix_caching: bool = True) -> None:
        super().__init__(torch.device("cpu"), prefix_caching)
        self.runs = []

    def run_held(self, held, block_size: int) -> None:
        self.runs.append([(rows.start, rows.ids, list(rows.block_ids)) for rows in held])


def _rows(n: int, first: float = 0.0) -> torch.Tensor:
    return torch.arange(first, first + n).unsqueeze(1).repeat(1, 2)


def _scheduled(request_id: str, start: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, [1], start, TABLE, True, SamplingParams(), [1], [], [])


def test_rows_are_held_until_drafts_or_a_full_chunk():
    d = Drafter(torch.device("cpu"))
    assert d.take_rows("a", TABLE, 10, [1], _rows(1, 10), run_now=False) is None
    assert d.take_rows("a", TABLE, 11, [2], _rows(1, 11), run_now=False) is None
    start, ids, hidden = d.take_rows("a", TABLE, 12, [3], _rows(1, 12), run_now=True)
    assert (start, ids) == (10, [1, 2, 3]) and hidden[:, 0].tolist() == [10, 11, 12]
    assert "a" not in d.pending
    d.upkeep_chunk = 3
    assert d.take_rows("b", TABLE, 0, [1, 2], None, run_now=False) is None
    assert d.take_rows("b", TABLE, 2, [3], None, run_now=False) == (0, [1, 2, 3], None)   # a full chunk runs


def test_rows_the_step_rewrites_replace_held_ones_and_a_gap_drops_them():
    d = Drafter(torch.device("cpu"))
    d.take_rows("a", TABLE, 0, [1, 2, 3], _rows(3), run_now=False)
    start, ids, hidden = d.take_rows("a", TABLE, 2, [7, 8], _rows(2, 20), run_now=True)  # position 2 again
    assert (start, ids) == (0, [1, 2, 7, 8]) and hidden[:, 0].tolist() == [0, 1, 20, 21]
    d.take_rows("a", TABLE, 0, [1, 2], None, run_now=False)
    assert d.take_rows("a", TABLE, 5, [9], None, run_now=True) == (5, [9], None)        # stale: recomputed later


def test_finished_and_preempted_requests_run_their_held_rows_before_leaving():
    """Their blocks stay in the prefix cache: the held rows reach the drafter's cache there, with the block
    table they were held with, before the step runs (an empty step too)."""
    d = RecordingDrafter()
    for rid, table in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        d.take_rows(rid, table, 4, [11, 12], None, run_now=False)
    d.begin_step(SchedulerOutput([], finished_request_ids=["a"], preempted_request_ids=["b"]), block_size=4)
    assert d.runs == [[(4, [11, 12], [1, 2]), (4, [11, 12], [3, 4])]]
    assert set(d.pending) == {"c"}
    d.begin_step(SchedulerOutput([], finished_request_ids=["a"]), block_size=4)     # told twice: nothing more
    assert len(d.runs) == 1


def test_without_prefix_caching_the_held_rows_of_finished_requests_are_dropped():
    d = RecordingDrafter(prefix_caching=False)
    d.take_rows("a", TABLE, 0, [1], None, run_now=False)
    d.begin_step(SchedulerOutput([], finished_request_ids=["a"]), block_size=4)
    assert d.runs == [] and not d.pending


def test_a_step_that_admits_a_prefix_hit_holds_nothing():
    """Only a request the drafter has not seen since its (re)admission that starts past position 0 found
    blocks in the prefix cache; a preempted request is new again when it comes back."""
    d = RecordingDrafter()
    assert not d.holds_nothing_now(SchedulerOutput([_scheduled("a", 0)]))
    assert not d.holds_nothing_now(SchedulerOutput([_scheduled("a", 8)]))          # its next chunk
    assert d.holds_nothing_now(SchedulerOutput([_scheduled("a", 9), _scheduled("b", 8)]))
    d.take_rows("a", TABLE, 9, [1], None, run_now=False)
    assert [rows.ids for rows in d.take_all_held()] == [[1]] and not d.pending
    d.begin_step(SchedulerOutput([], preempted_request_ids=["a"]), block_size=4)
    assert d.holds_nothing_now(SchedulerOutput([_scheduled("a", 8)]))
