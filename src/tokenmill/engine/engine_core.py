"""The step loop's body: schedule -> execute -> update. Token ids in, token ids out; no text.

Isolation: a step that raises is run again in halves until the request(s) at fault run alone, so a
request whose inputs break the step fails alone (RunnerOutput.failed) and its batch-mates get the tokens
they would have had without it. A failure outside the runner (scheduling, updating) is a bug no request
explains: it propagates, and the engine loop above treats it as fatal.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from tokenmill.config import EngineConfig
from tokenmill.core.decode_yield import DecodeYieldMeter
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.messages import RunnerOutput, SchedulerOutput
from tokenmill.core.policy import make_policy
from tokenmill.core.request import FinishReason, Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.spec_stats import SpecDecodeStats
from tokenmill.core.step_time import StepFeatures, StepTimeModel
from tokenmill.engine.step_trace import StepTrace
from tokenmill.outputs import TokenLogprobs
from tokenmill.platforms import Platform, resolve_platform
from tokenmill.sample.rejection import speculation_applies
from tokenmill.spec import make_proposer
from tokenmill.spec.adaptive import AdaptiveDraftLength
from tokenmill.executor import ExecutorFailed, make_executor

logger = logging.getLogger("tokenmill")


@dataclass
class CoreUpdate:
    """What one step did to one request."""
    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    error: str | None = None          # the request failed in this step (it is finished, with no new tokens)
    unavailable: bool = False         # ... because what served it is gone (a replica died), not by its fault


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float             # fraction of blocks referenced by requests, 0..1
    num_total_blocks: int
    num_used_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int   # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int      # prompt tokens found there
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_failed_requests_total: int = 0  # requests the engine ended with an error (FinishReason.ERROR)
    spec_decode: SpecDecodeStats | None = None   # speculative decoding counters (None: speculation off)
    expert_tokens: list[int] | None = None       # MoE: (token, expert) pairs per expert since start, all layers
    kv_bytes_per_token: int = 0                  # the cache's bytes per token, all ranks (MLA: the latent)
    block_size: int = 0                          # tokens per KV block


@dataclass(frozen=True)
class SpecStepSample:
    """One all-decode step's outcome for the adaptive draft length: it ran with draft length k for
    `decoding` requests and produced `tokens`; its seconds are its period, known when the next step starts."""
    k: int
    decoding: int
    tokens: int


@dataclass(frozen=True)
class OpenPeriod:
    """The latest step, whose period (its start to the next step's start) is still running."""
    features: StepFeatures
    start: float                      # perf_counter seconds
    speculation: SpecStepSample | None


def add_counts(total: list[int] | None, more: list[int] | None) -> list[int] | None:
    """Element-wise sum of two count lists, either of which may be None (nothing counted)."""
    if total is None or more is None:
        return list(more) if total is None and more is not None else total
    return [a + b for a, b in zip(total, more)]


class EngineCore:
    def __init__(self, config: EngineConfig, weights, platform: Platform | None = None) -> None:
        """Loads the model on `platform` (default: config.device's), then sizes the KV pool in the memory
        left (unless config.cache.num_blocks fixes it); self.config has the pool's size."""
        self.step_trace = StepTrace.from_env()         # None unless TOKENMILL_STEP_TRACE names a file
        self.platform = platform or resolve_platform(config.device)
        self.executor = make_executor(config, weights, self.platform)
        self.runner = self.executor.runner             # the in-process ModelRunner (uni executor), else None
        try:
            num_blocks = config.cache.num_blocks or self.executor.num_kv_blocks()
            self.config = config = replace(config, cache=replace(config.cache, num_blocks=num_blocks))
            self.executor.bind_kv_cache(num_blocks)
            self.decode_rows = self.executor.decode_rows()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        # fed by every executed step (seconds per step period), its features as the platform computes them
        self.step_model = StepTimeModel(rows=self.decode_rows)
        self._open_period: OpenPeriod | None = None
        self.expert_tokens: list[int] | None = None    # MoE models: summed RunnerOutput.expert_tokens
        self.scheduler = Scheduler(config.scheduler, self.kv, make_policy(config.scheduler.policy),
                                   self.step_model)
        spec = config.speculative
        self.proposer = make_proposer(spec) if spec is not None else None
        if self.proposer is not None:
            self.scheduler.decode_yield = DecodeYieldMeter()
        if self.proposer is not None and self.proposer.on_worker:     # drafts for the first steps
            self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens
        self.draft_length = AdaptiveDraftLength(spec.num_speculative_tokens) if spec is not None and spec.adaptive \
            else None                                  # None: always k
        # the draft length the drafts that requests bring to the next step were made with (their step's
        # SpecStepSample.k); a worker-side proposer's first drafts are chained with the initial lookahead
        self.drafts_k = spec.num_speculative_tokens if spec is not None else 0

    def check_fits(self, num_prompt_tokens: int, what: str = "prompt") -> None:
        self.scheduler.check_fits(num_prompt_tokens, what)

    def shutdown(self) -> None:
        """Stop the executor's workers (if any); idempotent."""
        self.executor.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()
            self.step_trace = None

    def replace_step_model(self, model: StepTimeModel) -> None:
        """Use `model` from now on, its features as this engine's platform computes them."""
        model.rows = self.decode_rows
        self.step_model = self.scheduler.step_model = model

    @contextmanager
    def speculation_paused(self):
        """Steps without drafts inside the block: the start-up calibration measures plain steps, and its
        random prompts would teach the draft length, the decode-yield meter and the counters nothing true
        of real traffic. The engine must be idle on entry and on exit (no request holds drafts)."""
        sched = self.scheduler
        saved = self.proposer, self.draft_length, sched.num_lookahead_tokens, sched.decode_yield
        self.proposer = self.draft_length = sched.decode_yield = None
        sched.num_lookahead_tokens = 0
        try:
            yield
        finally:
            self.proposer, self.draft_length, sched.num_lookahead_tokens, sched.decode_yield = saved

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_ids, reason: FinishReason = FinishReason.ABORT, stop_reason=None) -> list[Request]:
        aborted = self.scheduler.finish_requests(request_ids, reason, stop_reason)
        if not self.has_unfinished():
            self._open_period = None                   # no next step follows at once to close it
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[CoreUpdate]:
        t0 = time.perf_counter()
        self._close_period(t0)
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            self.executor.execute(sched_out)           # still hands over the finished ids
            return []
        runner_out = self._execute_isolated(sched_out)
        if runner_out.expert_tokens is not None:
            self.expert_tokens = add_counts(self.expert_tokens, runner_out.expert_tokens)
        produced = self.scheduler.update(sched_out, runner_out)
        seconds = time.perf_counter() - t0
        sample = None
        if self.proposer is not None:
            sample = self._propose(sched_out, produced, runner_out.draft_token_ids)
        if not runner_out.failed:                      # a bisected step's time describes no normal step
            self._open_or_observe(OpenPeriod(self.step_model.step_features(sched_out), t0, sample), seconds)
        return [CoreUpdate(req, ids, runner_out.logprobs.get(req.request_id, []),
                           runner_out.failed.get(req.request_id)) for req, ids in produced]

    def _open_or_observe(self, period: OpenPeriod, seconds: float) -> None:
        """The step-time model and the adaptive draft length see a step's period, what a decoding request's
        TPOT is made of: from its start to the next step's start, so the output processing, streaming and
        command handling between steps count. While requests remain, the next step follows at once and
        closes this period; otherwise the engine may idle, and the step's own seconds are observed."""
        if self.has_unfinished():
            self._open_period = period
        else:
            self._observe_period(period, seconds)

    def _close_period(self, now: float) -> None:
        if self._open_period is not None:
            period, self._open_period = self._open_period, None
            self._observe_period(period, now - period.start)

    def _observe_period(self, period: OpenPeriod, seconds: float) -> None:
        if self.step_trace is not None:
            self.step_trace.record(period.features, seconds, self.step_model.predict(period.features),
                                   len(self.scheduler.running), len(self.scheduler.waiting))
        self.step_model.observe(period.features, seconds)
        s = period.speculation
        if s is not None and self.draft_length is not None:
            self.draft_length.observe_step(s.k, s.decoding, seconds, s.tokens)

    def _propose(self, sched_out: SchedulerOutput, produced, worker_drafts) -> SpecStepSample | None:
        """Drafts for every running request whose next step is a decode (speculation_applies), at most k
        and no more than its max_tokens and the context leave room for. Adaptive: k from the acceptance so
        far and the periods of the steps before this one (spec/adaptive.py); returns this step's sample,
        observed when its period closes. A worker-side proposer's drafts came with the step
        (`worker_drafts`), chained with the lookahead chosen a step earlier: they are used as chained, and
        k goes to the scheduler's lookahead, for the drafts the worker chains next step (so k reaches the
        step after next, and every step carries the drafts of the k it is recorded under)."""
        k = self.config.speculative.num_speculative_tokens
        sample = None
        for rid in sched_out.finished_request_ids:
            self.proposer.drop(rid)
        if self.draft_length is not None:
            sample = self._observe_speculation(sched_out, produced)
            decoding = [r.num_tokens - 1 for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
            k = self.draft_length.choose(self.step_model, decoding)
        self.drafts_k = sched_out.num_lookahead_tokens if self.proposer.on_worker else k
        for request in self.scheduler.running:
            room = min(self.drafts_k, request.max_tokens - request.num_output_tokens - 1)
            if room <= 0 or request.num_computed_tokens != request.num_tokens - 1 \
                    or not speculation_applies(request.sampling_params, request.num_output_tokens):
                request.spec_token_ids = []
                continue
            if self.proposer.on_worker:
                request.spec_token_ids = worker_drafts.get(request.request_id, [])[:room]
            else:
                request.spec_token_ids = self.proposer.propose(request.request_id, request.all_token_ids, room)
        if self.proposer.on_worker:
            self.scheduler.num_lookahead_tokens = k
        return sample

    def _observe_speculation(self, sched_out: SchedulerOutput, produced) -> SpecStepSample | None:
        """Feed the adaptive draft length per request the accepted drafts; return the step's sample (under
        the draft length its drafts were made with) when every request in it decoded with all the drafts
        it brought (a step with prefill chunks, or one whose budget withheld drafts, says nothing about k)."""
        self._observe_requests(sched_out)
        if sched_out.num_requests_drafts_withheld:
            return None
        decoding = 0
        for sr in sched_out.scheduled:
            if sr.num_new_tokens - sr.num_draft_tokens != 1 or sr.start_position + 1 < len(sr.prompt_token_ids):
                return None
            decoding += 1
        if not decoding:
            return None
        return SpecStepSample(self.drafts_k, decoding, sum(len(ids) for _, ids in produced))

    def _observe_requests(self, sched_out: SchedulerOutput) -> None:
        for sr in sched_out.scheduled:
            if sr.num_draft_tokens:
                request = self.scheduler.requests.get(sr.request_id)
                if request is not None:
                    self.draft_length.observe_request(sr.num_draft_tokens, request.last_accepted_drafts)

    def _execute_isolated(self, sched_out: SchedulerOutput) -> RunnerOutput:
        """runner.execute; when it raises, each half of the step runs on its own (recursively), so only the
        requests that fail even alone are reported failed. A failed attempt leaves no trace: the runner
        restores the random generators it drew from, and the retry rewrites the same KV slots."""
        try:
            return self.executor.execute(sched_out)
        except ExecutorFailed:
            raise                                      # no request is to blame: fatal to the engine
        except Exception as e:  # noqa: BLE001 - traced to a request below, or reported for the one alone
            if len(sched_out.scheduled) == 1:
                request_id = sched_out.scheduled[0].request_id
                logger.exception("request %s failed in its step", request_id)
                return RunnerOutput({}, failed={request_id: f"the step failed: {type(e).__name__}: {e}"})
        mid = len(sched_out.scheduled) // 2
        first = replace(sched_out, scheduled=sched_out.scheduled[:mid])
        second = replace(sched_out, scheduled=sched_out.scheduled[mid:])
        return self._execute_isolated(first).merge(self._execute_isolated(second))

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_total_blocks=self.kv.num_blocks,
            num_used_blocks=self.kv.pool.num_used,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries_total=self.kv.prefix_queries_tokens,
            prefix_cache_hits_total=self.kv.prefix_hits_tokens,
            spec_decode=self.scheduler.spec_stats.copy() if self.proposer is not None else None,
            expert_tokens=None if self.expert_tokens is None else list(self.expert_tokens),
            kv_bytes_per_token=self.config.model.kv_bytes_per_token_all_ranks(
                self.config.parallel.tensor_parallel_size),
            block_size=self.config.cache.block_size,
        )
