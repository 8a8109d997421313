"""Scheduling policies: who is admitted first and who is preempted first. Add one by subclassing."""
from __future__ import annotations

from collections import deque

from tokenmill.core.request import Request


class SchedulingPolicy:
    """Orders the waiting queue and picks preemption victims. Running requests are always served first."""

    name = "base"

    def add_waiting(self, waiting: deque[Request], request: Request) -> None:
        raise NotImplementedError

    def readmit(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request goes back to the waiting queue."""
        raise NotImplementedError

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when blocks run out (lowest priority)."""
        raise NotImplementedError


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order; the latest arrival is preempted first and, being the
    oldest waiting work, resumes first."""

    name = "fcfs"

    def add_waiting(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def readmit(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name]()
