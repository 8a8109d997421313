"""The synchronous engine: text in, RequestOutputs out. Tokenizes, fans out n>1, detokenizes
incrementally, applies stop strings, stamps per-token times. Single-threaded: callers that need
concurrency wrap it (AsyncEngine).

Isolation: a request that fails in its step (EngineCore) or while its output is processed here ends alone,
all its completions with it, as a final RequestOutput whose `error` says why; the step goes on for the
others. `add_request` either enqueues the whole request or nothing."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from tokenmill.config import (CacheConfig, EngineArgs, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,
                              kv_cache_torch_dtype)
from tokenmill.core.request import FinishReason, Request
from tokenmill.engine.calibration import seed_step_model
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.engine_core import CoreUpdate, EngineCore, EngineStats
from tokenmill.engine.replicas import ReplicatedCore
from tokenmill.loaders import open_model_source
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.platforms import resolve_platform
from tokenmill.quant.prequantized import detect as detect_checkpoint_quant
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


@dataclass
class _Completion:
    """One of a request's n completions (one scheduler Request each)."""
    index: int
    request: Request
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list | None
    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    completions: list[_Completion]
    error: str | None = None          # why the engine failed this request (then it is finished)
    error_unavailable: bool = False   # it failed because its replica died (retryable elsewhere)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        self.args = args
        if args.num_threads:
            import torch
            torch.set_num_threads(args.num_threads)
        self.platform = resolve_platform(args.device)
        source = open_model_source(args.model, args.tokenizer)
        self.model_path = source.path
        self.tokenizer = source.load_tokenizer()
        config = self._make_config(args, source)
        self.step_model_source = "online"              # where the step-time model's prior came from
        if config.parallel.data_parallel_size > 1:       # replicas in their own processes (they calibrate)
            self.core = ReplicatedCore(config, config.parallel.data_parallel_size, args.num_threads,
                                       args.enable_prefix_caching)
            self.step_model_source = "replica 0"
        else:
            self.core = EngineCore(config, source.iter_weights(), self.platform)
            if self.core.scheduler.policy.needs_step_model or self.core.draft_length is not None:
                self.step_model_source = seed_step_model(self.core)
        self.config = self.core.config                   # with the KV pool's size
        self.eos_token_ids = self.config.model.eos_token_ids
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[_RequestState, int]] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_failed_requests_total = 0
        self.startup_s = time.perf_counter() - t0
        self._log_startup()

    # ---- set-up -----------------------------------------------------------------------------------
    def _make_config(self, args: EngineArgs, source) -> EngineConfig:
        model = ModelConfig.from_hf(source.hf_config, args.torch_dtype(self.platform.default_dtype))
        eos = tuple(dict.fromkeys(model.eos_token_ids + source.extra_eos_ids))
        model = replace(model, eos_token_ids=eos, kv_cache_dtype=kv_cache_torch_dtype(args.kv_cache_dtype))
        max_len = args.max_model_len or model.max_position_embeddings
        if max_len > model.max_position_embeddings:
            raise ValueError(f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                             f"{model.max_position_embeddings}")
        backend = self.platform.attention_backend_name(args.attention_backend)
        cache = CacheConfig(args.block_size, 0, args.enable_prefix_caching, args.kv_cache_memory_bytes,
                            args.kv_cache_memory_fraction, args.gpu_memory_utilization)
        return EngineConfig(
            model_path=source.path, model=model, cache=cache,
            scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_len,
                                      args.long_prefill_token_threshold, args.scheduling_policy),
            seed=args.seed, device=str(self.platform.device),
            attention_backend=backend,
            quantization=args.quantization, native_decode_layers=args.native_decode_layers,
            greedy_screen=args.greedy_screen, enforce_eager=args.enforce_eager,
            cuda_graph_max_batch=args.cuda_graph_max_batch, parallel=args.parallel_config(),
            num_threads=args.num_threads, speculative=SpeculativeConfig.parse(args.speculative_config),
            checkpoint_quant=detect_checkpoint_quant(source.hf_config, source.path))

    def _log_startup(self) -> None:
        c = self.config
        kv_bytes = c.cache.num_blocks * c.cache.block_size * c.model.kv_bytes_per_token_all_ranks(
            c.parallel.tensor_parallel_size)
        logger.info("tokenmill: %s (%s) on %s, %s, %d KV blocks x %d tokens = %.0f MiB, prefix caching %s, "
                    "start-up %.1f s", c.model.architecture, self.model_path, self.platform.describe(),
                    str(c.model.dtype).removeprefix("torch."), c.cache.num_blocks,
                    c.cache.block_size, kv_bytes / 2**20, "on" if c.cache.enable_prefix_caching else "off",
                    self.startup_s)

    def shutdown(self) -> None:
        """Stop the executor's worker processes or the data-parallel replicas, if any (idempotent;
        in-process engines have none)."""
        self.core.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ---- requests -----------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = False) -> None:
        """Validate and enqueue. Raises ValueError/TypeError (and enqueues nothing) for bad input."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self.check_request(len(ids), params, f"request {request_id}")
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        state = _RequestState(request_id, text, ids, params, stream, [])
        for i in range(params.n):
            state.completions.append(self._new_completion(state, i, arrival))
        for c in state.completions:    # "r#0" of a request "r" with n > 1 is taken too
            if c.request.request_id in self.child_to_parent:
                raise ValueError(f"request id {c.request.request_id!r} is already in use")
        self.requests[request_id] = state
        try:
            for c in state.completions:
                self.child_to_parent[c.request.request_id] = (state, c.index)
                self.core.add_request(c.request)
        except BaseException:                  # e.g. ExecutorFailed: no replica left; nothing stays queued
            self.core.abort([c.request.request_id for c in state.completions])
            self.requests.pop(request_id, None)
            for c in state.completions:
                self.child_to_parent.pop(c.request.request_id, None)
            raise
        self.prompt_tokens_total += len(ids) * params.n

    def check_request(self, num_prompt_tokens: int, params: SamplingParams, what: str = "prompt") -> None:
        """What add_request checks besides the prompt's ids (reads only configuration: safe from any
        thread). ValueError naming the parameter or the prompt's size at fault."""
        params.check_for_model(self.config.model.vocab_size, self.eos_token_ids)
        self.core.check_fits(num_prompt_tokens, what)

    def _new_completion(self, state: _RequestState, index: int, arrival: float) -> _Completion:
        params = state.params
        if params.n > 1 and params.seed is not None:
            params = params.replace(seed=params.seed + index)     # distinct yet reproducible completions
        child_id = state.request_id if state.params.n == 1 else f"{state.request_id}#{index}"
        request = Request(child_id, state.prompt_token_ids, params, self.eos_token_ids,
                          self.max_model_len, arrival_time=arrival)
        detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids,
                                       skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                                       include_stop_str_in_output=params.include_stop_str_in_output,
                                       min_tokens=params.min_tokens)
        return _Completion(index, request, detok, RequestMetrics(arrival),
                           [] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request (all its completions) now; returns its final output, or None if unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        self.core.abort([c.request.request_id for c in state.completions])
        return self._finish_if_done(state, time.perf_counter(), force=True)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight; with data-parallel replicas also news from a replica not yet read (its
        death, say), which the next step() learns even while no request runs: when none is left, step()
        raises ExecutorFailed."""
        return bool(self.requests) or (isinstance(self.core, ReplicatedCore) and self.core.has_unfinished())

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        updates = self.core.step()
        now = time.perf_counter()
        touched: dict[str, _RequestState] = {}
        failed: dict[str, tuple[_RequestState, str]] = {}
        for u in updates:
            state, index = self.child_to_parent[u.request.request_id]
            if state.request_id in failed:
                continue
            error = u.error or self._try_apply(state.completions[index], u, now)
            if error is not None:
                failed[state.request_id] = (state, error)
                state.error_unavailable = state.error_unavailable or u.unavailable
            else:
                touched[state.request_id] = state
        outputs = [self._fail(state, error, now) for state, error in failed.values()]
        for rid, state in touched.items():
            if rid not in failed:
                outputs.extend(self._output_or_fail(state, now))
        return outputs

    def _try_apply(self, c: _Completion, u: CoreUpdate, now: float) -> str | None:
        """_apply; an exception there fails this request alone. Returns the error, or None."""
        try:
            self._apply(c, u, now)
            return None
        except Exception as e:  # noqa: BLE001 - one request's output processing: fail it, not the step
            logger.exception("processing the output of request %s failed", u.request.request_id)
            return f"processing its output failed: {type(e).__name__}: {e}"

    def _output_or_fail(self, state: _RequestState, now: float) -> list[RequestOutput]:
        try:
            out = self._finish_if_done(state, now)
            if out is None and state.stream:
                out = self._make_output(state, finished=False)
        except Exception as e:  # noqa: BLE001 - as in _try_apply
            logger.exception("building the output of request %s failed", state.request_id)
            out = self._fail(state, f"building its output failed: {type(e).__name__}: {e}", now)
        return [] if out is None else [out]

    def _fail(self, state: _RequestState, error: str, now: float) -> RequestOutput:
        """End every completion of the request now, with finish_reason "error" and the error in the output."""
        state.error = f"request {state.request_id} failed in the engine: {error}"
        self.num_failed_requests_total += 1
        self.core.abort([c.request.request_id for c in state.completions], FinishReason.ERROR)
        return self._finish_if_done(state, now, force=True)

    def _apply(self, c: _Completion, u: CoreUpdate, now: float) -> None:
        m = c.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.first_scheduled_time = u.request.first_scheduled_time
        ids, upd = u.new_token_ids, None
        if len(ids) > 1 and c.detok.has_stop_strings:     # several tokens (speculation): a stop string may
            text = ""                                      # end inside the run; the rest is dropped
            for j, token in enumerate(ids):
                upd = c.detok.append([token])
                text += upd.new_text
                if upd.stop_string is not None:
                    del u.request.all_token_ids[len(u.request.all_token_ids) - (len(ids) - j - 1):]
                    ids = ids[:j + 1]
                    break
            upd = replace(upd, new_text=text)
        else:
            upd = c.detok.append(ids)
        m.token_times.extend([now] * len(ids))
        self.generation_tokens_total += len(ids)
        c.new_ids.extend(ids)
        if c.logprobs is not None:
            c.logprobs.extend(u.new_logprobs)
        c.new_text += upd.new_text
        if upd.stop_string is not None:
            self.core.abort(u.request.request_id, FinishReason.STOP, upd.stop_string)
            u.request.finish_reason, u.request.stop_reason = FinishReason.STOP, upd.stop_string
        elif u.request.is_finished:
            c.new_text += c.detok.finish().new_text   # release text held back for a possible stop string

    def _finish_if_done(self, state: _RequestState, now: float, force: bool = False) -> RequestOutput | None:
        if not force and not all(c.request.is_finished for c in state.completions):
            return None
        for c in state.completions:
            c.metrics.finished_time = now
            c.metrics.num_preemptions = c.request.num_preemptions
            c.metrics.num_spec_steps = c.request.num_spec_steps
            c.metrics.num_accepted_draft_tokens = c.request.num_accepted_draft_tokens
            if not c.detok.finished:
                self._release_held_text(state, c)
        self.requests.pop(state.request_id, None)      # absent when a failed first try is finished again
        for c in state.completions:
            self.child_to_parent.pop(c.request.request_id, None)
        return self._make_output(state, finished=True)

    @staticmethod
    def _release_held_text(state: _RequestState, c: _Completion) -> None:
        """Text held back for a possible stop string; on a failed request a broken detokenizer keeps it."""
        try:
            c.new_text += c.detok.finish().new_text
        except Exception:  # noqa: BLE001
            if state.error is None:
                raise

    def _make_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        outs = []
        for c in state.completions:
            r = c.request
            reason = r.finish_reason.value if r.finish_reason is not None else None
            outs.append(CompletionOutput(
                index=c.index, text=c.detok.text, token_ids=r.output_token_ids, finish_reason=reason,
                stop_reason=r.stop_reason, logprobs=list(c.logprobs) if c.logprobs is not None else None,
                new_token_ids=c.new_ids, new_text=c.new_text, metrics=c.metrics))
            c.new_ids, c.new_text = [], ""
        cached = state.completions[0].request.num_cached_tokens
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs, finished, cached,
                             error=state.error, error_unavailable=state.error_unavailable)

    def model_info(self) -> dict:
        """Static facts for efficiency reports: bytes the weights occupy as computed with (after any
        quantization), KV bytes per token, and where the model came from."""
        return {"model_path": self.model_path, "architecture": self.config.model.architecture,
                "weight_bytes": self.core.executor.weight_bytes(), "kv_bytes_per_token": self.config.model.kv_bytes_per_token,
                "max_model_len": self.max_model_len, "quantization": self.config.quantization,
                "num_kv_blocks": self.config.cache.num_blocks, "block_size": self.config.cache.block_size}

    def step_time_model(self) -> dict:
        """The step-time model now: coefficients (ms per unit), observations, where its prior came from,
        `replicas`: how many data-parallel replicas each run steps like it (1 without data parallel), and
        with speculation in one engine `decode_yield`: what a step computes and yields per decoding request
        (core/decode_yield.py; None otherwise)."""
        meter = None if isinstance(self.core, ReplicatedCore) else self.core.scheduler.decode_yield
        y = None if meter is None else meter.current
        return {"replicas": 1, **self.core.step_model.describe(), "source": self.step_model_source,
                "policy": self.config.scheduler.policy,
                "decode_yield": None if y is None else {"new_tokens": y.new_tokens, "decode_rows": y.decode_rows,
                                                        "prefill_tokens": y.prefill_tokens,
                                                        "output_tokens": y.output_tokens}}

    def replica_stats(self) -> list[EngineStats | None]:
        """Data parallel: each replica's last reported stats (None for a dead one); [] with one engine."""
        return self.core.replica_stats() if isinstance(self.core, ReplicatedCore) else []

    def stats(self) -> EngineStats:
        s = self.core.stats()
        s.prompt_tokens_total = self.prompt_tokens_total
        s.generation_tokens_total = self.generation_tokens_total
        s.num_failed_requests_total = self.num_failed_requests_total
        return s

