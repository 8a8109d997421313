"""A stand-in for `AsyncEngine` with the same public interface, for server tests that must not depend on
model speed: a step thread produces one token per running sequence every `step_s` seconds.

Output tokens cycle through a fixed list of ASCII word tokens (offset by the seed when sampling), so text
grows monotonically and is deterministic per (prompt, seed). KV accounting: each running request holds
`ceil(len / block_size)` blocks per sequence; blocks are freed on finish or abort.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass

from transformers import AutoTokenizer

from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs

WORDS = " alpha beta gamma delta epsilon zeta eta theta iota kappa"


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    num_used_blocks: int
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class _Req:
    def __init__(self, request_id, prompt_ids, params, loop, queue):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.loop = loop
        self.queue = queue
        now = time.perf_counter()
        self.seqs = [CompletionOutput(index=i, text="", token_ids=[], metrics=RequestMetrics(arrival_time=now),
                                      logprobs=[] if params.logprobs is not None else None)
                     for i in range(params.n)]

    def blocks(self, block_size: int) -> int:
        return sum(math.ceil((len(self.prompt_ids) + len(s.token_ids) + 1) / block_size) for s in self.seqs)


class FakeEngine:
    def __init__(self, tokenizer_dir: str, model_name: str = "fake-model", max_model_len: int = 256,
                 step_s: float = 0.01, max_num_seqs: int = 256, num_total_blocks: int = 4096,
                 block_size: int = 16) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.max_num_seqs = max_num_seqs
        self.num_total_blocks = num_total_blocks
        self.block_size = block_size
        self.word_ids = self.tokenizer(WORDS, add_special_tokens=False).input_ids
        self._lock = threading.Lock()
        self._running: dict[str, _Req] = {}
        self._waiting: list[_Req] = []
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- public API
    async def generate(self, prompt, params, request_id: str):
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        if len(ids) + (params.max_tokens or 1) > self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")
        queue: asyncio.Queue = asyncio.Queue()
        req = _Req(request_id, ids, params, asyncio.get_running_loop(), queue)
        with self._lock:
            self._waiting.append(req)
        while True:
            out = await queue.get()
            yield out
            if out.finished:
                return

    async def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._running.pop(request_id, None)
            if req is None:
                for r in self._waiting:
                    if r.request_id == request_id:
                        req = r
                        self._waiting.remove(r)
                        break
        if req is not None:
            for s in req.seqs:
                s.finish_reason = s.finish_reason or "abort"
            self._emit(req, finished=True)

    def stats(self) -> FakeStats:
        with self._lock:
            used = sum(r.blocks(self.block_size) for r in self._running.values())
            return FakeStats(num_running=len(self._running), num_waiting=len(self._waiting),
                             kv_cache_usage=used / self.num_total_blocks, num_total_blocks=self.num_total_blocks,
                             num_used_blocks=used, prompt_tokens_total=self._prompt_tokens,
                             generation_tokens_total=self._generation_tokens)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------------------- step loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.step_s)
            with self._lock:
                while self._waiting and len(self._running) < self.max_num_seqs:
                    req = self._waiting.pop(0)
                    self._running[req.request_id] = req
                    self._prompt_tokens += len(req.prompt_ids)
                    for s in req.seqs:
                        s.metrics.first_scheduled_time = time.perf_counter()
                for req in list(self._running.values()):
                    self._step(req)
                    finished = all(s.finish_reason for s in req.seqs)
                    if finished:
                        del self._running[req.request_id]
                    self._emit(req, finished)

    def _step(self, req: _Req) -> None:
        now = time.perf_counter()
        for s in req.seqs:
            if s.finish_reason:
                s.new_token_ids, s.new_text = [], ""
                continue
            offset = (req.params.seed or 0) + s.index if req.params.temperature > 0 else 0
            tok = self.word_ids[(len(s.token_ids) + offset) % len(self.word_ids)]
            s.token_ids.append(tok)
            self._generation_tokens += 1
            text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
            s.new_token_ids, s.new_text, s.text = [tok], text[len(s.text):], text
            if s.logprobs is not None:
                top = [Logprob(t, -1.0 - k) for k, t in enumerate(self.word_ids[:req.params.logprobs])]
                s.logprobs.append(TokenLogprobs(sampled=Logprob(tok, -0.5), top=top))
            s.metrics.token_times.append(now)
            if s.metrics.first_token_time is None:
                s.metrics.first_token_time = now
            if len(s.token_ids) >= req.params.max_tokens:
                s.finish_reason = "length"
                s.metrics.finished_time = now

    def _emit(self, req: _Req, finished: bool) -> None:
        out = RequestOutput(request_id=req.request_id, prompt=None, prompt_token_ids=req.prompt_ids,
                            outputs=[_copy(s) for s in req.seqs], finished=finished)
        req.loop.call_soon_threadsafe(req.queue.put_nowait, out)


def _copy(s: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(index=s.index, text=s.text, token_ids=list(s.token_ids), finish_reason=s.finish_reason,
                            logprobs=list(s.logprobs) if s.logprobs is not None else None,
                            new_token_ids=list(s.new_token_ids), new_text=s.new_text, metrics=s.metrics)
