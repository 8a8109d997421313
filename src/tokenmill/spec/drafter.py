"""Proposers that run on the worker, beside the target (`mtp`, draft models): they need the target's
hidden states or a model of their own, so they draft inside the step and return the drafts with its
output (RunnerOutput.draft_token_ids) instead of being asked on the host afterwards.

Life cycle, driven by the model runner:
    drafter = make_drafter(config, target, platform)    # builds and loads its layers, inside building()
    drafter.attention_layers()                          # its KV cache layers: the runner sizes and binds them
                                                        # with the target's (one pool, one block table)
    drafter.propose(step)                               # after the target's tokens are known

Every step, whatever k, the drafter feeds its layers the step's verified positions so its cache stays
complete; drafts come only for requests that sample, at most step.k each, and only for positions the block
table reaches (the scheduler's lookahead slots)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

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


class Drafter:
    name = "base"

    def __init__(self, device: torch.device) -> None:
        self.device = device

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
