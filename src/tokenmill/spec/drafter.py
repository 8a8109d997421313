"""Proposers that run on the worker, beside the target (`mtp`, draft models): they need the target's
hidden states or a model of their own, so they draft inside the step and return the drafts with its
output (RunnerOutput.draft_token_ids) instead of being asked on the host afterwards.

Life cycle, driven by the model runner:
    drafter = make_drafter(config, target, platform)    # builds and loads its layers, inside building()
    drafter.attention_layers()                          # its KV cache layers: the runner sizes and binds them
                                                        # with the target's (one pool, one block table)
    drafter.propose(step)                               # after the target's tokens are known

Every verified position reaches the drafter's layers, so its cache stays complete, but not necessarily in
the step that verified it: a request that drafts nothing this step (k = 0: speculation switched off by the
adaptive draft length) has its rows held (`take_rows`) until it drafts again or `upkeep_chunk` of them
wait, then they run as one chunk. On a CPU a layer's run on one row costs its per-op overheads, not its
arithmetic, so keeping the cache complete every step would cost k = 0 a tenth of a batch-1 step.
Drafts come only for requests that sample, at most step.k each, and only for positions the block table
reaches (the scheduler's lookahead slots)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

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
        self.ids.extend(ids)
        self.positions.extend(range(start, start + len(ids)))
        self.requests.append((sr.block_ids, start, len(ids)))
        if drafts_now:
            self.tails.append((sr, len(self.ids) - 1, start + len(ids) - 1))


@dataclass
class PendingRows:
    """A request's verified rows its drafter has not run yet: tokens at positions start, start + 1, ..."""
    start: int
    ids: list[int]
    hidden: torch.Tensor | None         # the target's hidden rows for them [len(ids), H] (MTP), or None


class Drafter:
    name = "base"
    upkeep_chunk = 32                   # a request's held rows run once this many wait (bounds their memory)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: dict[str, PendingRows] = {}

    def forget(self, sched_out: SchedulerOutput) -> None:
        """Drop the held rows of requests that finished or were preempted (their blocks are gone)."""
        for rid in (*sched_out.finished_request_ids, *sched_out.preempted_request_ids):
            self.pending.pop(rid, None)

    def take_rows(self, request_id: str, start: int, ids: list[int], hidden: torch.Tensor | None,
                  drafts_now: bool) -> tuple[int, list[int], torch.Tensor | None] | None:
        """The rows to run for a request now, from position `start` on: its held ones before the step's
        (held rows at or past the step's `start` are rewritten by it; held rows after a gap are stale),
        then the step's `ids` (hidden: their rows [len(ids), H], or None). None: all held for later."""
        held = self.pending.pop(request_id, None)
        if held is not None and held.start <= start <= held.start + len(held.ids):
            keep = start - held.start
            ids = held.ids[:keep] + list(ids)
            if hidden is not None and held.hidden is not None:
                hidden = torch.cat([held.hidden[:keep], hidden])
            start = held.start
        if drafts_now or len(ids) >= self.upkeep_chunk:
            return start, list(ids), hidden
        self.pending[request_id] = PendingRows(start, list(ids), None if hidden is None else hidden.clone())
        return None

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
