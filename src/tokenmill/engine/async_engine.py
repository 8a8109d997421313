"""AsyncEngine: the engine's step loop on its own thread, asyncio streams for callers.

Ownership: only the engine thread touches the LLMEngine, and only it runs parallel torch work while the
engine runs: the thread that built the engine gives its OpenMP team back first (platforms/host_threads.py).
Callers send commands (add, abort) through a queue and receive RequestOutputs on a per-request
asyncio.Queue, delivered with call_soon_threadsafe.

Lifetime rules (the loop never dies of a request):
- a caller may give up at any moment (cancelled while its add is queued, mid-prefill, mid-stream, after
  the last output): an add whose caller is gone is skipped, and a caller that stops iterating aborts its
  request, which frees its KV blocks. Neither is an error for the engine thread;
- a request the engine fails (LLMEngine isolation) raises RequestFailedError to its caller alone;
- if the loop itself raises (a bug no request explains), the engine is dead: `dead` says why, every
  in-flight and queued request gets EngineDeadError, every later `generate` raises it at once, and the
  `on_dead` callbacks run (the server answers /health 503 and exits non-zero).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Callable

from tokenmill.config import EngineArgs
from tokenmill.engine.engine_core import EngineStats
from tokenmill.engine.errors import EngineDeadError, RequestFailedError, RequestUnavailableError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.executor.base import ExecutorFailed
from tokenmill.outputs import RequestOutput
from tokenmill.platforms.host_threads import release_thread_pool
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

__all__ = ["AsyncEngine", "EngineDeadError", "RequestFailedError"]


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(args or EngineArgs())
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.args.model or "SmolLM2-135M-Instruct"
        self.max_model_len = self.engine.max_model_len
        self.dead: EngineDeadError | None = None    # set once, when the loop stops (shut down or died)
        self.died_of_bug = False                    # the loop stopped by an exception, not shutdown()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._submit_lock = threading.Lock()        # a command is queued only while the loop will read it
        self._on_dead: list[Callable[[EngineDeadError], None]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        release_thread_pool()        # the builder's OpenMP team would slow every step (host_threads.py)
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any asyncio loop) -------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as they come; the last has finished=True. Raises ValueError/TypeError for
        bad input before anything is queued, RequestFailedError when the engine fails this request,
        EngineDeadError when the engine is not running."""
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        admitted = concurrent.futures.Future()
        self._submit(("add", (request_id, prompt, params, loop, stream), admitted))
        finished = False
        try:
            await asyncio.wrap_future(admitted)
        except asyncio.CancelledError:   # gone while queued: the add is skipped, or aborted right after it
            self._submit(("abort", request_id, None), quiet=True)
            raise
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise (RequestUnavailableError if item.error_unavailable else RequestFailedError)(item.error)
                yield item
        finally:
            if not finished:
                self._submit(("abort", request_id, None), quiet=True)

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id, None), quiet=True)

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Run callback(error) on the engine thread when the loop stops (at once if it already has)."""
        with self._submit_lock:
            if self.dead is None:
                self._on_dead.append(callback)
                return
        callback(self.dead)

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """LLMEngine.check_request, from the caller's thread: lets a server answer 400 before it streams."""
        self.engine.check_request(num_prompt_tokens, params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def replica_stats(self) -> list:
        """See LLMEngine.replica_stats."""
        return self.engine.replica_stats()

    def model_info(self) -> dict:
        """See LLMEngine.model_info: weight bytes as computed with, KV bytes per token, model path."""
        return self.engine.model_info()

    def step_time_model(self) -> dict:
        """See LLMEngine.step_time_model (a snapshot; the engine thread keeps refitting it)."""
        return self.engine.step_time_model()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (waiting up to timeout_s for its step to end), then the executor's worker
        processes, if any, even when the loop is still in a step (that step then fails)."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout_s)
        self.engine.shutdown()

    def _submit(self, command: tuple, quiet: bool = False) -> None:
        """Queue a command for the engine thread; EngineDeadError (unless quiet) once the loop stopped."""
        with self._submit_lock:
            if self.dead is None:
                self._commands.put(command)
                return
        if not quiet:
            raise EngineDeadError(str(self.dead))

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as e:  # noqa: BLE001 - the loop is dead: say so to everyone, never hang
            if self._stop.is_set():              # shutdown() stopped the workers under this step
                self._stop_serving(EngineDeadError("the engine was shut down"))
                return
            logger.exception("the engine loop died")
            self.died_of_bug = True
            self._stop_serving(EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}"))
            return
        self._stop_serving(EngineDeadError("the engine was shut down"))

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, payload, admitted: concurrent.futures.Future | None) -> None:
        if kind == "add":
            if not admitted.set_running_or_notify_cancel():
                return                                     # the caller gave up before admission
            request_id, prompt, params, loop, stream = payload
            try:
                self.engine.add_request(request_id, prompt, params, stream=True)
            except ExecutorFailed as e:         # nothing left to run it on: the loop dies of it
                admitted.set_exception(EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}"))
                raise
            except Exception as e:  # noqa: BLE001 - bad input: the caller's error, not the loop's
                admitted.set_exception(e)
                return
            self._streams[request_id] = (loop, stream)
            admitted.set_result(None)
        elif kind == "abort":
            out = self.engine.abort_request(payload)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput | BaseException, request_id: str | None = None) -> None:
        request_id = request_id or out.request_id
        target = self._streams.get(request_id)
        if target is None:
            return
        if isinstance(out, BaseException) or out.finished:
            del self._streams[request_id]
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, out)
        except RuntimeError:   # the caller's loop is closed: nobody is listening
            pass

    def _stop_serving(self, error: EngineDeadError) -> None:
        """No command is accepted from now on; queued adds, in-flight requests and callbacks get `error`."""
        with self._submit_lock:
            self.dead = error
            callbacks, self._on_dead = self._on_dead, []
        while True:
            try:
                kind, payload, admitted = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and admitted.set_running_or_notify_cancel():
                admitted.set_exception(error)
        for request_id in list(self._streams):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the engine may be what failed: still tell every caller
                logger.exception("abort of %s failed", request_id)
            self._deliver(EngineDeadError(str(error)), request_id)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("an on_dead callback failed")
