"""AsyncEngine: the engine's step loop on its own thread, asyncio streams for callers.

Ownership: only the engine thread touches the LLMEngine. Callers send commands (add, abort) through a
queue and receive RequestOutputs on a per-request asyncio.Queue, delivered with call_soon_threadsafe.
A caller that stops iterating (client gone) aborts its request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator

from tokenmill.config import EngineArgs
from tokenmill.engine.engine_core import EngineStats
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(args or EngineArgs())
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.args.model or "SmolLM2-135M-Instruct"
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any asyncio loop) -------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as they come; the last has finished=True. Raises ValueError/TypeError for
        bad input before anything is queued."""
        if self._stop.is_set():
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        done = concurrent.futures.Future()
        self._commands.put(("add", (request_id, prompt, params, loop, stream), done))
        await asyncio.wrap_future(done)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(("abort", request_id, None))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def model_info(self) -> dict:
        """See LLMEngine.model_info: weight bytes as computed with, KV bytes per token, model path."""
        return self.engine.model_info()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout_s)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished_requests()
            self._drain_commands(block)
            if self._stop.is_set():
                break
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug in a step: fail the in-flight requests, keep serving
                logger.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out)
        self._fail_all(EngineDeadError("the engine was shut down"))

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

    def _apply(self, kind: str, payload, done) -> None:
        if kind == "add":
            request_id, prompt, params, loop, stream = payload
            try:
                self.engine.add_request(request_id, prompt, params, stream=True)
            except Exception as e:
                done.set_exception(e)
                return
            self._streams[request_id] = (loop, stream)
            done.set_result(None)
        elif kind == "abort":
            out = self.engine.abort_request(payload)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, out)
        except RuntimeError:   # the caller's loop is closed: nobody is listening
            pass

    def _fail_all(self, error: BaseException) -> None:
        for rid, (loop, stream) in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:   # the engine may be what failed: still tell every caller
                logger.exception("abort of %s failed", rid)
            try:
                loop.call_soon_threadsafe(stream.put_nowait, error)
            except RuntimeError:
                pass
        self._streams.clear()
