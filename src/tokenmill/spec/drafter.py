"""Proposers that run on the worker, beside the target (`mtp`, draft models): they need the target's
hidden states or a model of their own, so they draft inside the step and return the drafts with its
output (RunnerOutput.draft_token_ids) instead of being asked on the host afterwards.

Life cycle, driven by the model runner:
    drafter = make_drafter(config, target, platform)    # builds and loads its layers, inside building()
    drafter.attention_layers()                          # its KV cache layers: the runner sizes and binds them
                                                        # with the target's (one pool, one block table)
    drafter.begin_step(sched_out, block_size)           # every step, empty ones too: requests that ended
    drafter.propose(step)                               # after the target's tokens are known

Every verified position reaches the drafter's layers, so its cache stays complete, but not necessarily in
the step that verified it: a request that drafts nothing this step (k = 0: speculation switched off by the
adaptive draft length; or it never drafts, e.g. it asks for logprobs) has its rows held (`take_rows`) until
it drafts again or `upkeep_chunk` of them wait, then they run as one chunk. On a CPU a layer's run on one
row costs its per-op overheads, not its arithmetic, so keeping the cache complete every step would cost
k = 0 a tenth of a batch-1 step. No row is still held when another request may read its slot:
- a request that finished or was preempted leaves its blocks in the prefix cache (for a later prompt with
  that prefix, or its own re-admission): `begin_step` runs its held rows before any of the step's rows,
  which may write those blocks for their new owner;
- a request admitted past position 0 reads blocks from the prefix cache, whose rows the request that
  computed them may still hold: that step holds no rows (`holds_nothing_now`), every held row runs.
Drafts come only for requests that sample, at most step.k each, and only for positions the block table
reaches (the scheduler's lookahead slots)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tokenmill.core.messages import SchedulerOutput


@dataclass
class DraftStep:
    """What a drafter sees of one step."""
    sched_out: SchedulerOutput
    query_starts: list[int]             # first row of each scheduled request in the step's batch
    hidden: torch.Tensor                # [T, hidden] the target's final hidden states of every row
    sampled: dict[str, list[int]]       # request id -> tokens the step produced (accepted drafts + one)
    k: int                              # drafts to propose per request (0: only keep the cache complete)
    block_size: int


@dataclass
class DraftBatch:
    """The rows a drafter runs in one step, each request's consecutive, and the rows drafts start from."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    requests: list = field(default_factory=list)   # (block table, start position, rows): step_tensors' input
    tails: list = field(default_factory=list)      # (scheduled request, its last row, that row's position)

    def add(self, sr, start: int, ids: list[int], drafts_now: bool) -> None:
        """Request sr's tokens `ids` at positions start, start + 1, ...; drafts_now: it drafts from the last."""
        self._add_rows(sr.block_ids, start, ids)
        if drafts_now:
            self.tails.append((sr, len(self.ids) - 1, start + len(ids) - 1))

    def add_held(self, rows: "PendingRows") -> None:
        """A request's held rows, to fill its cache (no drafts from them)."""
        self._add_rows(rows.block_ids, rows.start, rows.ids)

    def _add_rows(self, block_ids, start: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.positions.extend(range(start, start + len(ids)))
        self.requests.append((block_ids, start, len(ids)))


@dataclass
class PendingRows:
    """A request's verified rows its drafter has not run yet: tokens at positions start, start + 1, ..."""
    start: int
    ids: list[int]
    hidden: torch.Tensor | None         # the target's hidden rows for them [len(ids), H] (MTP), or None
    # the request's block table when they were held: it keeps covering their positions (the scheduler only
    # appends blocks, or frees trailing ones past the request's tokens), after the request ends too
    block_ids: Sequence[int]


class Drafter:
    name = "base"
    upkeep_chunk = 32                   # a request's held rows run once this many wait (bounds their memory)

    def __init__(self, device: torch.device, prefix_caching: bool = True) -> None:
        self.device = device
        self.prefix_caching = prefix_caching   # blocks outlive their request, and so does what they hold
        self.pending: dict[str, PendingRows] = {}
        self.admitted: set[str] = set()        # requests the drafter has seen since their (re)admission

    def begin_step(self, sched_out: SchedulerOutput, block_size: int) -> None:
        """Before every step (empty ones too): forget the requests that finished or were preempted. With
        prefix caching their held rows run first, before any of this step's rows may write their blocks:
        whoever hits those blocks later reads the drafter's cache there as well."""
        ended = (*sched_out.finished_request_ids, *sched_out.preempted_request_ids)
        self.admitted.difference_update(ended)
        held = [rows for rid in ended if (rows := self.pending.pop(rid, None)) is not None]
        if held and self.prefix_caching:
            self.run_held(held, block_size)

    def holds_nothing_now(self, sched_out: SchedulerOutput) -> bool:
        """Whether this step must run every row rather than hold any: it admits a request past position 0,
        i.e. onto blocks from the prefix cache, whose rows the request that computed them may still hold.
        Notes the step's requests as admitted."""
        scheduled = sched_out.scheduled
        hit = any(sr.start_position > 0 and sr.request_id not in self.admitted for sr in scheduled)
        self.admitted.update(sr.request_id for sr in scheduled)
        return hit

    def take_all_held(self) -> list[PendingRows]:
        """Every request's held rows, no longer held."""
        held, self.pending = list(self.pending.values()), {}
        return held

    def take_rows(self, request_id: str, block_ids: Sequence[int], start: int, ids: list[int],
                  hidden: torch.Tensor | None, run_now: bool) -> tuple[int, list[int], torch.Tensor | None] | None:
        """The rows to run for a request now, from position `start` on: its held ones before the step's
        (held rows at or past the step's `start` are rewritten by it; held rows after a gap are stale),
        then the step's `ids` (hidden: their rows [len(ids), H], or None). None: all held for later
        (unless run_now, or upkeep_chunk of them wait). block_ids: the request's block table."""
        held = self.pending.pop(request_id, None)
        if held is not None and held.start <= start <= held.start + len(held.ids):
            keep = start - held.start
            ids = held.ids[:keep] + list(ids)
            if hidden is not None and held.hidden is not None:
                hidden = torch.cat([held.hidden[:keep], hidden])
            start = held.start
        if run_now or len(ids) >= self.upkeep_chunk:
            return start, list(ids), hidden
        self.pending[request_id] = PendingRows(start, list(ids), None if hidden is None else hidden.clone(),
                                               block_ids)
        return None

    def run_held(self, held: list[PendingRows], block_size: int) -> None:
        """Write the drafter's cache for held rows (their requests' own block tables), drafting nothing."""
        raise NotImplementedError

    def attention_layers(self) -> list:
        return []

    def propose(self, step: DraftStep) -> dict[str, list[int]]:
        raise NotImplementedError

    def step_tensors(self, ids: list[int], positions: list[int], requests, block_size: int):
        """The drafter's own forward inputs on its device: (ids [T], positions [T], attention metadata)
        for `requests` = (block table, start position, new tokens) with their rows consecutive."""
        from tokenmill.worker.input_batch import StepInputs, build_attention_metadata
        inputs = StepInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                            build_attention_metadata(requests, block_size), torch.empty(0, dtype=torch.long), [])
        inputs = inputs.to(self.device)
        return inputs.input_ids, inputs.positions, inputs.meta


def reaches(sr, position: int, block_size: int) -> bool:
    """Whether the request's block table has a slot for `position` (lookahead slots included)."""
    return position < len(sr.block_ids) * block_size


DRAFTERS = {"mtp": "tokenmill.spec.mtp:MTPDrafter",     # speculative method -> module:class
            "draft_model": "tokenmill.spec.draft_model:DraftModelDrafter"}


def make_drafter(config, target, platform) -> Drafter:
    module, cls = DRAFTERS[config.speculative.method].split(":")
    return getattr(importlib.import_module(module), cls)(config, target, platform)
