"""AsyncEngine.shutdown stops the executor's workers even when the loop is stuck in a step past the wait
(the step then fails, which is the shutdown's doing, not a bug that kills the server)."""
from __future__ import annotations

import threading

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.executor import ExecutorFailed


class _EngineStuckInAStep:
    """What AsyncEngine reads of an LLMEngine; step() blocks until shutdown() stops the workers."""
    tokenizer = None
    max_model_len = 64

    class args:
        model = "stuck"

    def __init__(self) -> None:
        self.in_step, self.workers_stopped = threading.Event(), threading.Event()

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self) -> list:
        self.in_step.set()
        self.workers_stopped.wait(60)
        raise ExecutorFailed("the workers were stopped")

    def shutdown(self) -> None:
        self.workers_stopped.set()


def test_shutdown_stops_the_workers_of_a_loop_stuck_in_a_step():
    stuck = _EngineStuckInAStep()
    engine = AsyncEngine(engine=stuck)
    assert stuck.in_step.wait(30)
    engine.shutdown(timeout_s=0.1)
    assert stuck.workers_stopped.is_set()
    engine._thread.join(30)
    assert not engine._thread.is_alive()
    assert str(engine.dead) == "the engine was shut down" and not engine.died_of_bug
