"""Scheduling policies: who is admitted first, how much one step may compute, who is preempted first.
Add one by subclassing SchedulingPolicy and registering it in POLICIES.

The scheduler owns the mechanics (KV blocks, preemption, chunking); a policy only answers questions:
each step's budget (begin_step), the order running requests are served in, the order of the waiting queue,
whether one more request may start, whether a prefill chunk may pass the step's time limit, and which
running request gives up its blocks when they run out; it hears of each finished request (request_finished).
"""
from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from tokenmill.core.request import Request
from tokenmill.core.step_time import NO_WORK, StepFeatures, StepTimeModel, chunk_work

if TYPE_CHECKING:
    from tokenmill.core.scheduler import Scheduler


_ROUNDING_S = 1e-9      # predicted times are float sums: a reserve sized for exact drafts must not miss the last
                        # one by rounding


@dataclass
class StepBudget:
    """What is left of one step. tokens: new tokens (decode tokens and prefill chunks). allowance_s: the
    predicted seconds the step's work may take beyond the model's intercept (inf: no time limit), or a
    callable that computes them, asked once, when a grant first needs the time left: a decode token is
    always granted while tokens are left (a running request never stalls), so a step of decodes alone never
    pays for its limit. A prefill chunk is sized into the time left (`prefill_seconds`), but the step's first chunk
    may take min_prefill_chunk tokens past it, so prefills always progress. Each grant adds its work to
    `step`; the time left is the allowance less what the model predicts `step` adds to an empty step, so
    the step's first prefill chunk pays the model's per-step prefill costs (per_prefill_step, and
    per_mixed_step where decode rows were granted before it), later ones only their tokens.
    draft_reserve_s: seconds of the allowance that prefill chunks may not take, kept for the drafts granted
    last (or a callable, asked with the allowance): where drafts lower the time per output token, a step
    held to its limit spends it on them. A prefill chunk granted past the time left (the step's minimum
    chunk, or a timeless one) lengthens the step by its excess and leaves the reserve whole."""
    tokens: int
    allowance_s: float | Callable[[], float] = math.inf
    model: StepTimeModel | None = None
    min_prefill_chunk: int = 0
    draft_reserve_s: float | Callable[[], float] = 0.0
    prefill_granted: bool = False
    _work: list[int] = field(default_factory=lambda: [0, 0, 0])   # granted so far: decode rows, prefill
                                       # tokens, context reads (counted only with a model)
    _overdraft_s: float = 0.0          # predicted seconds prefill chunks were granted past prefill_seconds

    @property
    def step(self) -> StepFeatures:
        """The work granted so far."""
        return StepFeatures(*self._work)

    @property
    def seconds(self) -> float:
        """Predicted seconds left in the step (inf: no time limit); drafts may take all of it."""
        if callable(self.allowance_s):
            self.allowance_s = self.allowance_s()
        if self.model is None or not math.isfinite(self.allowance_s):
            return self.allowance_s
        return self.allowance_s - (self.model.predict(self.step) - self.model.predict(NO_WORK))

    @property
    def prefill_seconds(self) -> float:
        """Predicted seconds left in the step for prefill chunks: `seconds` less the drafts' reserve."""
        seconds = self.seconds
        if not math.isfinite(seconds):
            return seconds
        if callable(self.draft_reserve_s):
            self.draft_reserve_s = self.draft_reserve_s()
        return seconds - self.draft_reserve_s

    def grant(self, start_position: int, wanted: int, timeless: bool = False, floor: int = 0) -> int:
        """How many of `wanted` new tokens from start_position this step computes; charges them.
        timeless: the chunk is not held to the time left (only to the tokens); it is still charged.
        floor: this chunk's own minimum past the time left, if above min_prefill_chunk (the step's first)."""
        n = min(wanted, self.tokens)
        if n <= 0:
            return 0
        seconds = self.prefill_seconds if self.model is not None and n > 1 else math.inf
        if math.isfinite(seconds) and not timeless:
            fits = self.model.max_chunk(start_position, n, seconds, self.step)
            if fits < n and not self.prefill_granted:
                fits = max(fits, min(n, max(self.min_prefill_chunk, floor)))
            n = fits
        if n <= 0:
            return 0
        if math.isfinite(seconds):            # a chunk past the time left does not take the drafts' reserve
            self._overdraft_s += max(self.model.chunk_marginal(start_position, n, self.step) - max(seconds, 0.0), 0.0)
        self.tokens -= n
        self.prefill_granted |= n > 1
        self._charge(start_position, n)
        return n

    def _charge(self, start_position: int, n: int, sign: int = 1) -> None:
        if self.model is not None:
            for i, v in enumerate(chunk_work(start_position, n, self.model.rows)):
                self._work[i] += sign * v

    def _uncharge(self, start_position: int, n: int) -> None:
        self._charge(start_position, n, -1)

    def grant_drafts(self, start_position: int, wanted: int) -> int:
        """How many of `wanted` draft tokens may follow the decode token granted at start_position: drafts
        come last in a step, from the tokens and time its own work left (never past them); charges them as
        the growth of that decode row into a chunk of 1 + n tokens."""
        n = min(wanted, self.tokens)
        if n <= 0:
            return 0
        if self.model is not None:
            self._uncharge(start_position, 1)
            seconds = self.seconds + self._overdraft_s + _ROUNDING_S
            if math.isfinite(seconds):
                n = max(self.model.max_chunk(start_position, 1 + n, seconds, self.step) - 1, 0)
            self._charge(start_position, 1 + n)
        self.tokens -= n
        return n

    def refund_drafts(self, start_position: int, n: int) -> None:
        """Give back a grant_drafts that was not scheduled (no KV slots for it)."""
        self.tokens += n
        if n:
            self._uncharge(start_position, 1 + n)
            self._charge(start_position, 1)

    def checkpoint(self) -> tuple:
        """What has been granted so far, for `rollback`."""
        return self.tokens, self.prefill_granted, tuple(self._work), self._overdraft_s

    def rollback(self, checkpoint: tuple) -> None:
        """Undo every grant made since `checkpoint` was taken, exactly: tokens, work, the prefill flag and the
        overdraft (a chunk granted but not scheduled, for want of KV blocks, leaves no trace on later grants)."""
        self.tokens, self.prefill_granted, work, self._overdraft_s = checkpoint
        self._work = list(work)


class SchedulingPolicy:
    """Orders the waiting queue and picks preemption victims; the base class has no time limits."""

    name = "base"
    needs_step_model = False          # True: the engine calibrates the step-time model at start-up

    def begin_step(self, scheduler: "Scheduler", now: float) -> StepBudget:
        return StepBudget(scheduler.config.max_num_batched_tokens)

    def running_order(self, running: list[Request]) -> list[Request]:
        """The order running requests are given tokens in (a new list)."""
        return list(running)

    def add_waiting(self, waiting: deque[Request], request: Request) -> None:
        raise NotImplementedError

    def readmit(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request goes back to the waiting queue."""
        raise NotImplementedError

    def order_waiting(self, waiting: deque[Request], scheduler: "Scheduler", now: float) -> None:
        """Reorder the waiting queue (in place) before admission; the head is admitted first."""

    def may_admit(self, request: Request, scheduler: "Scheduler", now: float) -> bool:
        """Whether `request` (the head of the waiting queue) may start now; False stops admission this step."""
        return True

    def prefill_is_urgent(self, request: Request, scheduler: "Scheduler", now: float) -> bool:
        """Whether `request`'s next prefill chunk may exceed the step's time limit (its TTFT is at stake)."""
        return False

    def prefill_floor(self, request: Request, scheduler: "Scheduler") -> int:
        """Tokens of `request`'s next prefill chunk that a step's first chunk may take past the time limit,
        where more than the budget's min_prefill_chunk (0: that minimum)."""
        return 0

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out (lowest priority)."""
        raise NotImplementedError

    def request_finished(self, request: Request) -> None:
        """`request` left the scheduler (request.finish_reason says why); its blocks are already freed."""

    @contextmanager
    def learning_paused(self):
        """Requests that arrive and finish inside the block teach the policy nothing (the start-up
        calibration's synthetic requests are no load and no output lengths). The base class learns nothing."""
        yield


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order, fixed limits; the latest arrival is preempted first and,
    being the oldest waiting work, resumes first."""

    name = "fcfs"

    def add_waiting(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def readmit(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    import tokenmill.core.slo_policy  # noqa: F401 - registers "slo"
    return sorted(POLICIES)


def make_policy(name: str) -> SchedulingPolicy:
    if name not in policy_names():
        raise ValueError(f"unknown scheduling policy {name!r}; expected one of {policy_names()}")
    return POLICIES[name]()
