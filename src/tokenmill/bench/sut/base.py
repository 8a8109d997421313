"""The SUT interface: issue one sample, fill its `RequestRecord`, never raise."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from tokenmill.bench.records import RequestRecord, Sample

Clock = Callable[[], float]     # seconds since the run start (time.perf_counter based)
FirstTokenHook = Callable[[RequestRecord], None] | None   # called once, as the first token arrives


class SUT(ABC):
    """A system under test. `process` stamps `sent_s` when the request leaves, `first_token_s` when the
    first output token arrives, one entry in `chunk_times_s` per streamed update, and `completed_s` at
    the end; it records failures in `record.error` instead of raising."""

    name: str = "sut"
    tokenizer = None            # a HF tokenizer when one is known (re-tokenization, synthetic prompts)
    # (TTFT ms, TPOT ms) sent with each request as its latency targets, where the SUT can carry them
    # (set per run by BenchSession: the profile's limits for Server runs, None for Offline)
    latency_targets: tuple[float | None, float | None] | None = None

    async def start(self) -> None:
        """Load / connect before the timed run."""

    @abstractmethod
    async def process(self, sample: Sample, record: RequestRecord, clock: Clock,
                      on_first_token: FirstTokenHook = None) -> None:
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request the runner gave up on (timeout)."""

    def finalize(self, records: list[RequestRecord]) -> None:
        """Post-run work kept out of the timed path (e.g. re-tokenizing streamed text)."""

    async def close(self) -> None:
        """Release resources after all runs."""

    def describe(self) -> dict:
        return {"name": self.name}
