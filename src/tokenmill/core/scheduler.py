"""Token-budget scheduler: each step hands out "n tokens for this request", with no prefill/decode phases.

Per step: the policy sets the step's budget (tokens, and predicted seconds by the step-time model);
running requests first (in the policy's order) get what they need (1 decode token, or a prefill chunk),
then waiting requests are admitted, in the policy's order and while it agrees, while the budget, the
sequence limit and the KV pool allow; last, decoding requests' speculative drafts take what the budget and
the pool have left (drafts never displace prefill work nor cost a preemption: in a step that prefill fills,
a draft token costs as much compute as a prompt token and is often rejected; in a step that preempted,
the pool is too tight to spend on drafts). When the pool runs dry for a running request, the policy's
victim is preempted (blocks freed, to be recomputed later from its tokens, which reproduces exactly the
same continuation). Every executed step is fed back to the step-time model (EngineCore times it).
"""
from __future__ import annotations

import time
from collections import deque

from tokenmill.config import SchedulerConfig
from tokenmill.core.decode_yield import DecodeYieldMeter
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.messages import RunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.core.policy import FCFSPolicy, SchedulingPolicy, StepBudget
from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.core.step_time import StepTimeModel
from tokenmill.core.spec_stats import SpecDecodeStats


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 policy: SchedulingPolicy | None = None, step_model: StepTimeModel | None = None,
                 clock=time.perf_counter) -> None:
        self.config = config
        self.clock = clock                        # seconds; the clock of Request.arrival_time
        self.kv = kv_manager
        self.policy = policy or FCFSPolicy()
        self.step_model = step_model or StepTimeModel()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_since_last_step: list[str] = []
        self.num_preemptions_total = 0
        self.spec_stats = SpecDecodeStats()
        self.trimmed_since_last_step: list[str] = []
        # worker-side drafting: every request that samples gets slots for this many positions past its
        # new tokens (the drafter writes its own cache there while chaining drafts)
        self.num_lookahead_tokens = 0
        # with speculation: what a step computes and yields per decoding request, measured (policies read
        # it) on request steps that got all the drafts they brought (the yield drafting as proposed gives,
        # not what a step's budget left of it); None: no speculation, one decode row and one output token each
        self.decode_yield: DecodeYieldMeter | None = None
        self.drafts_withheld: set[str] = set()   # this step's decoding requests granted fewer drafts than brought

    # ---- admission and removal -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.request_id)
        # a request alone never outgrows the pool, so preemption always ends with someone making progress
        request.max_model_len = min(request.max_model_len, self.config.max_model_len,
                                    self.kv.num_blocks * self.kv.block_size)
        self.requests[request.request_id] = request
        self.policy.add_waiting(self.waiting, request)

    def check_fits(self, num_prompt_tokens: int, what: str = "prompt") -> None:
        check_prompt_fits(num_prompt_tokens, self.config.max_model_len, self.kv.num_blocks * self.kv.block_size, what)

    def finish_requests(self, request_ids, reason: FinishReason, stop_reason=None) -> list[Request]:
        """Finish requests from outside (abort, stop strings). Unknown or finished ids are ignored."""
        done = []
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason, request.stop_reason = reason, stop_reason
            self._free(request)
            done.append(request)
        return done

    def _free(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_since_last_step.append(request.request_id)
        self.policy.request_finished(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        budget = self.policy.begin_step(self, now)
        self.kv.begin_step()
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._schedule_running(budget, scheduled, preempted, now)
        if not preempted:
            self.policy.order_waiting(self.waiting, self, now)
            self._schedule_waiting(budget, scheduled, now)
        self.drafts_withheld = self._schedule_drafts(budget, scheduled, allowed=not preempted)
        out = SchedulerOutput(scheduled, self.finished_since_last_step, preempted, self.trimmed_since_last_step,
                              self.num_lookahead_tokens, len(self.drafts_withheld))
        self.finished_since_last_step, self.trimmed_since_last_step = [], []
        return out

    def _chunk(self, request: Request, start: int, budget: StepBudget, now: float) -> int:
        n = request.num_tokens - start
        threshold = self.config.long_prefill_token_threshold
        timeless = n > 1 and self.policy.prefill_is_urgent(request, self, now)
        floor = self.policy.prefill_floor(request, self) if n > 1 and not timeless else 0
        return budget.grant(start, min(n, threshold) if threshold > 0 else n, timeless, floor)

    def _schedule_running(self, budget: StepBudget, scheduled: list, preempted: list, now: float) -> None:
        pending = self.policy.running_order(self.running)      # not yet scheduled this step
        while pending and budget.tokens > 0:
            request = pending[0]
            checkpoint = budget.checkpoint()
            num_new = self._chunk(request, request.num_computed_tokens, budget, now)
            if num_new == 0:                                   # no time left for its chunk this step
                pending.pop(0)
                continue
            start = request.num_computed_tokens
            while self._allocate(request, start, num_new) is None:
                victim = self.policy.pick_victim(pending)      # never one already scheduled
                pending.remove(victim)
                self._preempt(victim, preempted)
                if victim is request:
                    budget.rollback(checkpoint)
                    break
            else:
                self.kv.note_computing(request, start + num_new)
                scheduled.append(self._scheduled(request, num_new))
                pending.pop(0)

    def _preempt(self, request: Request, preempted: list) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.policy.readmit(self.waiting, request)
        preempted.append(request.request_id)

    def _schedule_waiting(self, budget: StepBudget, scheduled: list, now: float) -> None:
        while self.waiting and budget.tokens > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.policy.may_admit(request, self, now):
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if self.kv.computes_next_block(request, len(hits)):
                break                                 # next step it hits what this step computes
            checkpoint = budget.checkpoint()
            num_new = self._chunk(request, num_hit_tokens, budget, now)
            if num_new == 0:
                break
            if self._allocate(request, num_hit_tokens, num_new, hits) is None:
                budget.rollback(checkpoint)           # the drafts granted last may have its share
                break
            self.kv.record_prefix_lookup(request, num_hit_tokens)   # once per admission, not per retry
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.kv.note_computing(request, num_hit_tokens + num_new)
            scheduled.append(self._scheduled(request, num_new))

    def _schedule_drafts(self, budget: StepBudget, scheduled: list, allowed: bool = True) -> set[str]:
        """Each decoding request with drafts (in scheduled order) grows its 1 decode token by as many drafts
        as the budget left and the pool has slots for (none where not `allowed`). Returns the ids of the
        requests that got fewer drafts than they brought."""
        threshold, withheld = self.config.long_prefill_token_threshold, set()
        for i, sr in enumerate(scheduled):
            request = self.requests[sr.request_id]
            wanted = len(request.spec_token_ids)
            if threshold > 0:
                wanted = min(wanted, threshold - 1)
            if not wanted or sr.num_new_tokens != 1 or sr.start_position != request.num_tokens - 1:
                continue
            num_drafts = budget.grant_drafts(sr.start_position, wanted) if allowed else 0
            if num_drafts and self._allocate(request, sr.start_position, 1 + num_drafts) is None:
                budget.refund_drafts(sr.start_position, num_drafts)
                num_drafts = 0
            if num_drafts:
                scheduled[i] = self._scheduled(request, 1 + num_drafts)
            if num_drafts < wanted:
                withheld.add(request.request_id)
        return withheld

    def _allocate(self, request: Request, start: int, num_new: int, hits=None):
        """Slots for the new tokens, plus lookahead slots for a worker-side drafter when the request samples
        this step (as many as it may draft, within its context window) where the pool has them: a drafter
        chains only as far as the block table reaches, so lookahead never costs a preemption."""
        lookahead = 0
        if self.num_lookahead_tokens and start + num_new >= request.num_tokens:
            lookahead = max(0, min(self.num_lookahead_tokens, request.max_model_len - start - num_new))
        if lookahead and self.kv.allocate_slots(request, num_new + lookahead, hits) is not None:
            return True
        return self.kv.allocate_slots(request, num_new, hits)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """num_new tokens from its computed ones: its own, then (a decode with drafts) as many drafts as
        the budget left room for."""
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start:start + num_new]
        num_drafts = start + num_new - request.num_tokens
        if num_drafts > 0:
            token_ids = token_ids + request.spec_token_ids[:num_drafts]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_new >= request.num_tokens,
            num_draft_tokens=max(num_drafts, 0),
            params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=request.eos_token_ids,
        )

    # ---- after the step ------------------------------------------------------------------------
    def update(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> list[tuple[Request, list[int]]]:
        """Advance computed counts, append sampled tokens, put the blocks a request's step completed in the
        prefix cache (a failed request's step caches nothing), finish requests that stop or failed.
        Returns (request, new token ids) for every request that produced tokens or failed this step."""
        produced = []
        for sr in sched_out.scheduled:
            request = self.requests.get(sr.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if sr.request_id in runner_out.failed:
                self._fail(request)
                produced.append((request, []))
                continue
            sampled = runner_out.sampled_token_ids.get(sr.request_id, ())
            # of the drafts, only the accepted ones (all but the last sampled token) hold valid KV
            rejected = sr.num_draft_tokens - max(len(sampled) - 1, 0) if sr.num_draft_tokens else 0
            request.num_computed_tokens += sr.num_new_tokens - rejected
            decoding = request.num_output_tokens > 0
            new_ids = self._append_tokens_and_cache(request, sampled)
            self._record_yield(sr, request, decoding, len(new_ids))
            if rejected and not request.is_finished and self.kv.trim(request, request.num_tokens):
                self.trimmed_since_last_step.append(request.request_id)   # blocks only rejected drafts filled
            if new_ids and request.first_token_time is None:
                request.first_token_time = self.clock()
            if new_ids:
                produced.append((request, new_ids))
        return produced

    def _record_yield(self, sr: ScheduledRequest, request: Request, decoding: bool, num_kept: int) -> None:
        """Feed the decode-yield meter and the speculation counters one request's step, by the tokens it
        kept (num_kept): sampled tokens past a stop token or max_tokens are dropped, and so are the drafts
        they accepted. A stop string is found later, by the engine's detokenizer: the tokens past it still
        count here (a step's last few at most). decoding: the request had output tokens before the step."""
        if self.decode_yield is not None and decoding \
                and sr.num_new_tokens - sr.num_draft_tokens == 1 and sr.request_id not in self.drafts_withheld:
            self.decode_yield.record(self.step_model.chunk_features(sr.start_position, sr.num_new_tokens),
                                     num_kept)
        if sr.num_draft_tokens:
            request.spec_token_ids = []
            accepted = max(num_kept - 1, 0)          # the first kept token is the target's own
            self.spec_stats.record(sr.num_draft_tokens, accepted)
            request.num_spec_steps += 1
            request.last_accepted_drafts = accepted
            request.num_accepted_draft_tokens += accepted

    def _fail(self, request: Request) -> None:
        """Finish a request whose step failed. The blocks that step was to fill may hold partial KV, but
        they never entered the prefix cache (only a step that succeeded caches what it wrote), so no other
        request has read them or ever will."""
        self.running.remove(request)
        request.finish_reason, request.stop_reason = FinishReason.ERROR, None
        self._free(request)

    def _append_tokens_and_cache(self, request: Request, token_ids) -> list[int]:
        """After a successful step: append its sampled tokens up to a stop, then put the blocks the step
        completed in the prefix cache (their KV is written now), then finish the request if it stopped.
        Returns the tokens kept."""
        accepted, stopped = [], False
        for token_id in token_ids:
            request.append_output_token(token_id)
            accepted.append(token_id)
            if request.check_stop(token_id):
                stopped = True
                break
        self.kv.cache_computed_blocks(request)
        if stopped:
            self.running.remove(request)
            self._free(request)
        return accepted


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int, capacity_tokens: int, what: str = "prompt") -> None:
    """A prompt that could never be scheduled is an error now, not a hang later: the prompt and one output
    token must fit both the context window and the whole KV pool (capacity_tokens)."""
    if num_prompt_tokens == 0:
        raise ValueError(f"{what}: the prompt is empty; at least one token is needed")
    if num_prompt_tokens + 1 > min(max_model_len, capacity_tokens):
        raise ValueError(
            f"{what}: {num_prompt_tokens} prompt tokens plus 1 output token do not fit: the context "
            f"window is {max_model_len} tokens and the KV cache holds {capacity_tokens} tokens")
