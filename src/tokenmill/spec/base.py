"""The proposer interface."""
from __future__ import annotations

from typing import Sequence


class Proposer:
    """Proposes draft tokens for requests from what each has so far; may keep per-request state (dropped
    with `drop` when the request ends)."""
    name = "base"
    one_hot = True              # drafts are certain guesses (q = one-hot): rejection sampling needs no q
    on_worker = False           # True: drafts come from the worker with each step (spec/drafter.py)

    def __init__(self, config) -> None:
        self.config = config

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft ids to follow token_ids (the request's prompt + output so far); [] for none."""
        raise NotImplementedError

    def drop(self, request_id: str) -> None:
        """Forget a finished request."""


class WorkerProposer(Proposer):
    """The host side of a proposer that drafts on the worker (spec/drafter.py): its drafts arrive with each
    step's output (RunnerOutput.draft_token_ids), so it is never asked here."""
    on_worker = True

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        raise RuntimeError(f"{self.name} drafts are made on the worker (RunnerOutput.draft_token_ids)")
