"""The interface between the engine core and the ranks that run the model."""
from __future__ import annotations

from tokenmill.core.messages import RunnerOutput, SchedulerOutput
from tokenmill.core.step_time import DecodeRows


def narrowest(rules: list[DecodeRows]) -> DecodeRows:
    """The steps every rank computes as decode rows."""
    return DecodeRows(min(r.max_query_len for r in rules), min(r.max_rows for r in rules))


class ExecutorFailed(RuntimeError):
    """A worker died, hung or could not start: fatal to the engine (no request is to blame)."""


class Executor:
    name = "base"
    runner = None            # the in-process ModelRunner, where there is one (uni)

    def num_kv_blocks(self) -> int:
        """KV blocks every rank can hold (the least of the ranks'), after the weights are loaded."""
        raise NotImplementedError

    def bind_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes the weights occupy as computed with (after any quantization), summed over the ranks."""
        raise NotImplementedError

    def decode_rows(self) -> DecodeRows:
        """Which steps the ranks compute as decode rows (core/step_time.py), after bind_kv_cache: the
        narrowest of the ranks' (they run each step together)."""
        raise NotImplementedError

    def execute(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """One step on every rank. Raises the step's error (a request's fault: the core bisects), or
        ExecutorFailed (fatal). With several ranks any rank's error is ExecutorFailed: a step that failed
        on one rank may have left the others' collectives out of step with it, so it cannot be rerun."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
