"""What the completion and chat handlers share: admission (429), prompt checks, sampling parameters, and
`EngineCall`, the engine requests behind one HTTP request.

Lifetime rule: every engine request the server starts belongs to an `EngineCall`, and `EngineCall.close()`
runs on every exit path (finished, client disconnect, error, shutdown). It aborts the engine requests
that have not finished, which frees their KV blocks, and gives the admission slot back.

Counting rule: every completion an `EngineCall` admits is counted exactly once in request_success_total:
with its finish reason when the engine reports it finished; as "error" when the engine fails its request
first; else as "abort" at close (the client went away or the server stopped, even before the request
reached the engine: the server had accepted it, and nobody got its output). A request that the engine
refuses as invalid (a 400), or that meets a dead engine, is not counted.
"""
from __future__ import annotations

import asyncio
import functools
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from tokenmill.engine.errors import EngineDeadError, RequestFailedError, RequestUnavailableError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import OpenAIError, bad_request, from_value_error
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import PromptTokensDetails, SamplingRequest, Usage


OPENAI_MAX_TEMPERATURE = 2.0   # OpenAI's range is [0, 2]; SamplingParams alone allows up to MAX_TEMPERATURE


async def in_thread(fn, *args):
    """fn(*args) in a worker thread (CPU-heavy request preparation: tokenizing, chat templates)."""
    return await anyio.to_thread.run_sync(fn, *args)


def engine_dead_error(e: EngineDeadError) -> OpenAIError:
    return OpenAIError(503, f"the engine is not running: {e}", type="server_error", code="engine_dead")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Admission:
    """Bounds the sequences in flight to the running batch plus `max_waiting_requests`.

    Two checks: the server's own count (exact, immune to requests the engine has not picked up yet) and
    the engine's waiting queue (catches a batch held back by a full KV cache)."""

    def __init__(self, engine, max_running: int, config: ServerConfig) -> None:
        self.engine = engine
        self.max_running = max_running
        self.max_waiting = config.max_waiting_requests
        self.retry_after_s = config.retry_after_s
        self.num_in_flight = 0   # sequences (prompts x n) admitted and not yet closed

    def acquire(self, num_seqs: int) -> None:
        capacity = self.max_running + self.max_waiting
        if num_seqs > capacity:   # retrying would not help: a client mistake, not a full queue
            raise bad_request(f"the request needs {num_seqs} sequences (prompts x n), more than this server holds "
                              f"at once ({capacity}: a batch of {self.max_running} plus {self.max_waiting} waiting)",
                              param="n")
        over_total = self.num_in_flight + num_seqs > self.max_running + self.max_waiting
        num_waiting = self.engine.stats().num_waiting
        over_queue = num_waiting > 0 and num_waiting + num_seqs > self.max_waiting
        if over_total or over_queue:
            message = (f"server is at capacity: {self.num_in_flight} sequences in flight, {num_waiting} "
                       f"waiting (limit {self.max_waiting} waiting beyond a batch of {self.max_running}); "
                       f"retry later")
            raise OpenAIError(429, message, code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        self.num_in_flight += num_seqs

    def release(self, num_seqs: int) -> None:
        self.num_in_flight -= num_seqs


@dataclass
class Serving:
    """Everything a handler needs; one per app."""
    engine: object
    config: ServerConfig
    metrics: ServerMetrics
    admission: Admission
    draining: bool = False
    live_calls: set = field(default_factory=set)   # EngineCalls not yet closed

    async def abort_all(self) -> None:
        """End every in-flight request with finish_reason "abort"; their responses then complete normally."""
        for call in list(self.live_calls):
            for engine_id in list(call.unfinished):
                await self.engine.abort(engine_id)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"model '{model}' does not exist; this server serves '{self.model_name}'",
                              param="model", code="model_not_found")

    def check_accepting(self) -> None:
        if self.engine.dead is not None:
            raise engine_dead_error(self.engine.dead)
        if self.draining:
            raise OpenAIError(503, "server is shutting down", code="shutting_down")

    # ------------------------------------------------------------------------------------- prompts
    # Handlers run tokenization and chat templates in a worker thread (`in_thread`): the tokenizer releases
    # the GIL, so a megabyte prompt never stalls the event loop (and every other client) for seconds.
    def encode(self, text: str, add_special_tokens: bool = True, fit_context: bool = False) -> list[int]:
        """Token ids of `text`. fit_context: a text too long to leave room for one output token in the
        context window is a 400 before it is tokenized at all (see max_prompt_bytes)."""
        if fit_context and len(text) > self.max_prompt_bytes // 4:     # UTF-8 takes at most 4 bytes a character
            num_bytes = len(text.encode("utf-8"))
            if num_bytes > self.max_prompt_bytes:
                limit = self.engine.max_model_len
                raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt is "
                                  f"{num_bytes} bytes, more than {limit - 1} tokens of this tokenizer can hold",
                                  param="prompt", code="context_length_exceeded")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    @functools.cached_property
    def max_prompt_bytes(self) -> int:
        """Most UTF-8 bytes of text that max_model_len - 1 tokens can cover: the longest token's bytes
        (its piece as the vocabulary spells it, never shorter than the text it stands for) times the
        tokens. Only a tokenizer that does not normalize text can shrink it below that; for one that
        does, no bound (sys.maxsize)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return sys.maxsize
        longest = max(len(piece.encode("utf-8")) for piece in backend.get_vocab())
        return longest * (self.engine.max_model_len - 1)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.tokenizer)
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} in '{param}' is outside the vocabulary [0, {vocab})", param=param)

    def resolve_max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> int:
        """The output budget; a prompt plus max_tokens beyond the context window is a 400 naming the numbers."""
        limit = self.engine.max_model_len
        if num_prompt_tokens == 0:
            raise bad_request("the prompt is empty (0 tokens)", param="prompt")
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"invalid value for '{param}': expected an integer >= 1, got {max_tokens}", param=param)
        if max_tokens is None:
            if num_prompt_tokens >= limit:
                raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt has "
                                  f"{num_prompt_tokens} tokens, which leaves no room for output",
                                  param="prompt", code="context_length_exceeded")
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but you requested "
                              f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                              f"{max_tokens} for the completion); reduce the prompt or {param}",
                              param=param, code="context_length_exceeded")
        return max_tokens

    # ------------------------------------------------------------------------------ sampling params
    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompts: list[list[int]]) -> SamplingParams:
        """The request's SamplingParams, checked against OpenAI's ranges, the server's limits and what the
        engine can compute for these prompts; a 400 naming the field otherwise."""
        if not 1 <= req.n <= self.config.max_n:
            raise bad_request(f"invalid value for 'n': expected an integer in [1, {self.config.max_n}], "
                              f"got {req.n}", param="n")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        if req.temperature is not None and not 0.0 <= req.temperature <= OPENAI_MAX_TEMPERATURE:
            raise bad_request(f"invalid value for 'temperature': expected a number in [0, {OPENAI_MAX_TEMPERATURE:g}], "
                              f"got {req.temperature!r}", param="temperature")
        values = dict(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      repetition_penalty=req.repetition_penalty, seed=req.seed, stop=_as_tuple(req.stop),
                      stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                      min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
                      skip_special_tokens=req.skip_special_tokens, max_tokens=max_tokens, logprobs=logprobs,
                      ttft_target_ms=_first(req.ttft_target_ms, self.config.slo_ttft_ms),
                      tpot_target_ms=_first(req.tpot_target_ms, self.config.slo_tpot_ms))
        try:
            params = SamplingParams(**{k: v for k, v in values.items() if v is not None})
            for num_prompt_tokens in sorted({len(ids) for ids in prompts}):
                self.engine.check_request(num_prompt_tokens, params)
        except ValueError as e:
            raise from_value_error(e) from None
        return params

    def check_logprobs(self, value: int | None, param: str) -> None:
        limit = self.config.max_logprobs
        if value is not None and not 0 <= value <= limit:
            raise bad_request(f"invalid value for '{param}': expected an integer in [0, {limit}], got {value}",
                              param=param)

    def start(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> "EngineCall":
        """Admit (or 429) and return the call (params: one per prompt); nothing reaches the engine until it
        is iterated."""
        self.check_accepting()
        num_seqs = sum(p.n for p in params)
        self.admission.acquire(num_seqs)
        call = EngineCall(self, request_id, prompts, params, num_seqs)
        self.live_calls.add(call)
        return call


def check_stream_options(req: SamplingRequest) -> None:
    """stream_options applies to streamed responses only; given without stream=true it is a client mistake
    (a 400, as in vLLM), not an option to ignore."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be given when stream is true; set stream to true or leave "
                          "stream_options out (or null)", param="stream_options")


def per_prompt_params(params: SamplingParams, max_tokens: list[int]) -> list[SamplingParams]:
    """params for each prompt, with that prompt's own output budget; prompts with equal budgets share one."""
    by_budget = {params.max_tokens: params}
    for budget in set(max_tokens) - by_budget.keys():
        by_budget[budget] = params.replace(max_tokens=budget)
    return [by_budget[budget] for budget in max_tokens]


def _first(*values):
    return next((v for v in values if v is not None), None)


def _as_tuple(stop: str | list[str] | None) -> tuple[str, ...] | None:
    if stop is None:
        return None
    return (stop,) if isinstance(stop, str) else tuple(stop)


class EngineCall:
    """The engine requests of one HTTP request (one per prompt, with its params); `close()` is idempotent.
    See the counting rule in the module docstring."""

    def __init__(self, serving: Serving, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
                 num_seqs: int) -> None:
        self.serving = serving
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.num_seqs = num_seqs
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.unfinished = set(self.engine_ids)
        self.final: list[RequestOutput | None] = [None] * len(prompts)
        self.counted: list[set[int]] = [set() for _ in prompts]   # per prompt: completion indexes counted
        self.closed = False

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as the engine produces them, all prompts interleaved."""
        if len(self.prompts) == 1:
            async for out in self._one(0):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.prompts))]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            async for out in self._one(i):
                queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait(e)
        queue.put_nowait(None)

    async def _one(self, i: int) -> AsyncIterator[RequestOutput]:
        engine_id = self.engine_ids[i]
        counted = self.counted[i]
        try:
            async for out in self.serving.engine.generate(self.prompts[i], self.params[i], engine_id):
                for o in out.outputs:
                    if o.finish_reason is not None and o.index not in counted:
                        counted.add(o.index)
                        self.serving.metrics.observe_finished(o, self.params[i])
                if out.finished:
                    self.unfinished.discard(engine_id)
                    self.final[i] = out
                yield out
        except (ValueError, TypeError) as e:
            self.unfinished.discard(engine_id)
            raise from_value_error(e) from None
        except RequestUnavailableError as e:   # its replica died; the others serve on: retry
            self.unfinished.discard(engine_id)
            self._count_the_rest(i, "error")
            raise OpenAIError(503, str(e), type="server_error", code="replica_unavailable",
                              headers={"Retry-After": "1"}) from None
        except RequestFailedError as e:   # this request alone failed in the engine; the engine serves on
            self.unfinished.discard(engine_id)
            self._count_the_rest(i, "error")
            raise OpenAIError(500, str(e), type="server_error", code="request_failed") from None
        except EngineDeadError as e:
            self.unfinished.discard(engine_id)
            raise engine_dead_error(e) from None

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.serving.admission.release(self.num_seqs)
        self.serving.live_calls.discard(self)
        with anyio.CancelScope(shield=True):
            for i, engine_id in enumerate(self.engine_ids):
                if engine_id in self.unfinished:
                    self.unfinished.discard(engine_id)
                    await self.serving.engine.abort(engine_id)
                    self._count_the_rest(i, "abort")    # nobody reads their final output

    def _count_the_rest(self, i: int, reason: str) -> None:
        """Counts the completions of prompt i not counted yet as ended by `reason` (then all are counted)."""
        counted, n = self.counted[i], self.params[i].n
        if len(counted) < n:
            self.serving.metrics.count_finished(n - len(counted), reason)
            counted.update(range(n))

    def usage(self) -> Usage:
        """Usage over the final outputs (prompt tokens once per prompt, every generated token)."""
        done = [o for o in self.final if o is not None]
        prompt_tokens = sum(o.num_prompt_tokens for o in done)
        completion_tokens = sum(o.num_generated_tokens for o in done)
        cached = sum(o.num_cached_tokens for o in done)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def logprob_token_text(tokenizer, token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else tokenizer.decode([token_id])
