"""AsyncEngine hands a step's outputs to each caller loop in one wake-up, in step order, and each stream
still gets exactly its own outputs, ending with the finished one."""
from __future__ import annotations

import asyncio
import threading

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import RequestOutput

REQUESTS, STEPS = 5, 4


class _LockstepEngine:
    """What AsyncEngine reads of an LLMEngine: once all REQUESTS are added, each step yields one output
    per request; the STEPS-th finishes them all."""
    tokenizer = None
    max_model_len = 64

    class args:
        model = "lockstep"

    def __init__(self) -> None:
        self.added: list[str] = []
        self.steps = 0
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt, params, stream=True) -> None:
        self.added.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return len(self.added) == REQUESTS and self.steps < STEPS

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        return [RequestOutput(rid, None, [self.steps], [], finished=self.steps == STEPS) for rid in self.added]

    def abort_request(self, request_id):
        return None

    def shutdown(self) -> None:
        pass


def test_a_steps_outputs_reach_a_loop_in_one_wake_up():
    fake = _LockstepEngine()
    engine = AsyncEngine(engine=fake)
    wakeups = []

    async def collect(rid: str) -> list[tuple[list[int], bool]]:
        return [(out.prompt_token_ids, out.finished) async for out in engine.generate("x", None, rid)]

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            if threading.current_thread() is engine._thread:
                wakeups.append(callback)
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(*(collect(f"r{i}") for i in range(REQUESTS)))

    try:
        streams = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        engine.shutdown()
    for got in streams:                            # each stream: its STEPS outputs, in order, the last finished
        assert got == [([s], s == STEPS) for s in range(1, STEPS + 1)]
    output_wakeups = [w for w in wakeups if getattr(w, "__name__", "") == "_put_all"]
    assert len(output_wakeups) == STEPS            # one per step for the one loop (it was one per output)
