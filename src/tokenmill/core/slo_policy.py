"""The SLO policy (`scheduling_policy="slo"`): steps and admission sized to the latency targets, by the
step-time model.

MLPerf judges a request by its TTFT (arrival to first token) and its TPOT, the mean step time over its whole
decode. A TPOT is an average over a hundred steps or so: it is set by the batch a request decodes in over its
life, far more than by any one step. So, per step:
- time limit: each running request with a TPOT target allows a steady step plus part of its slack, the time
  its projected TPOT (time so far, then steady steps over a horizon) leaves below margin * target; the
  tightest sets the limit (requests that even decode-only steps cannot keep on target do not shrink it:
  they complete, counted);
- remaining tokens: max_tokens is only a ceiling; core/output_length.py estimates from finished requests how
  many more a running request produces. The time limit takes a low quantile of it (a request that stops
  soon has few steps left to average a long step out), the forecasts its mean;
- running decodes first (one token each, always), then prefill chunks sized into the time left (the first
  chunk gets min_prefill_chunk tokens regardless, or a piece large enough that the per-step prefill costs
  it adds are a small share of it (prefill_floor), so prefills always progress; a request past
  prefill_urgent_fraction of its TTFT allowance gets its whole chunk: TPOT first, until a TTFT miss is near).
  A TTFT allowance is the time from arrival to the latest start of the step computing the rest of the prompt
  whole (the deadline less that step's predicted time);
- waiting requests by least slack against their TTFT deadline (arrival + target, or + default_ttft_s for
  requests without one: the deadline ages them); those whose TTFT is already lost (waited past their TTFT
  allowance) after every request that can still meet its target, and any request held max_hold_s before all
  (nothing starves);
- admission by forecast (core/batch_forecast.py): the batch over the coming steps, running requests leaving
  as their tokens run out and new ones arriving at the recent rate; a request waits while, in that forecast,
  it would run past margin * its target or would push a running request past its own, provided a running
  request is forecast to leave before it has waited max_hold_s (else the batch it joins later is no smaller,
  and holding it only spends its TTFT). A held request is not admitted because its TTFT runs short: a TTFT
  miss is one request's, while a batch pushed past its TPOT bar misses every running request's target (near
  the step-time bound, admitting held requests as their deadlines near turns a burst's queue into a batch
  past the TPOT limit). When even one request alone would miss, admission serves throughput.
It drops nothing: a request that cannot meet its target still runs to completion.

With speculation a decoding request computes 1 + d tokens a step and yields 1 + a output tokens (drafts
granted, drafts accepted): the scheduler measures both (core/decode_yield.py). Steps are priced by what they
compute and TPOTs by what they yield, so a request's remaining tokens take remaining / yield steps; without
speculation (PLAIN) every formula reduces to one row and one token a step.
"""
from __future__ import annotations

import functools
import math
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.core.batch_forecast import ArrivalRate, BatchForecast
from tokenmill.core.decode_yield import PLAIN, DecodeYield
from tokenmill.core.output_length import OutputLengths
from tokenmill.core.policy import FCFSPolicy, StepBudget, register_policy
from tokenmill.core.request import FinishReason, Request, RequestStatus
from tokenmill.core.step_time import StepFeatures

if TYPE_CHECKING:
    from tokenmill.core.scheduler import Scheduler


@dataclass(frozen=True)
class SLOPolicyConfig:
    tpot_margin: float = 0.95         # steps aim at this fraction of the TPOT target
    slack_spend: float = 0.5          # fraction of a request's slack (beyond steady steps) one step may spend
    horizon_steps: int = 32           # steps ahead a request's TPOT projection spreads this step over
    default_ttft_s: float = 10.0      # TTFT deadline of requests without a target (aging)
    min_prefill_chunk: int = 16       # tokens a step's first prefill chunk may take past the time limit
    max_hold_s: float = 30.0          # no request waits for admission longer than this (s): past it, it goes
                                      # first and is admitted regardless (nothing starves)
    prefill_urgent_fraction: float = 0.75   # a prefill past this fraction of its TTFT allowance ignores the
                                      # time limit
    whole_prefill_ttft_ratio: float = 3.5   # a prompt whose TTFT allowance is under this many times its
                                      # prefill's time is not cut for the time limit (prefill_floor)
    rate_window_s: float = 60.0       # arrival rate over this window (the forecast's future arrivals)
    rate_min_span_s: float = 10.0     # ... and over at least this span (a burst is not a rate)
    forecast_max_steps: int = 512     # a request's remaining tokens counted at most this far ahead
    horizon_quantile: float = 0.1     # the time limit's horizon: this quantile of a request's remaining tokens
    max_piece_overhead: float = 0.25  # a prefill piece is cut no smaller than its tokens' time is this
                                      # fraction of the per-step prefill costs it adds
    length_window: int = 512          # finished requests the output-length estimate learns from

    def __post_init__(self) -> None:
        if not self.max_piece_overhead > 0:
            raise ValueError(f"SLOPolicyConfig.max_piece_overhead must be > 0 (math.inf: no floor beyond "
                             f"min_prefill_chunk), got {self.max_piece_overhead!r}")


def _tpot_s(r: Request) -> float | None:
    t = r.sampling_params.tpot_target_ms
    return None if t is None else t / 1e3


def _stops_by_itself(r: Request) -> bool:
    """r may end before max_tokens: by EOS, a stop token id or a stop string."""
    p = r.sampling_params
    return bool(p.stop or p.stop_token_ids or (r.eos_token_ids and not p.ignore_eos))


def decode_yield(scheduler: "Scheduler") -> DecodeYield:
    """What a step does for a decoding request, as the scheduler measured it (PLAIN: no speculation)."""
    meter = scheduler.decode_yield
    return PLAIN if meter is None else meter.current


def _deadline(r: Request, cfg: SLOPolicyConfig) -> float:
    t = r.sampling_params.ttft_target_ms
    return r.arrival_time + (cfg.default_ttft_s if t is None else t / 1e3)


@register_policy
class SLOPolicy(FCFSPolicy):
    """FCFS's queue mechanics (a preempted request resumes first), with SLO-driven budgets and order."""

    name = "slo"
    needs_step_model = True

    def __init__(self, config: SLOPolicyConfig | None = None) -> None:
        self.config = config or SLOPolicyConfig()
        self.arrivals, self.lengths = self._new_meters()
        self._mean_memo: dict[tuple[str, int, int], int] = {}   # remaining_mean's answers while `lengths`
                                      # and the step stand (an admission test asks it ~6 times a request)
        self._cached_memo: dict[str, int] = {}   # waiting requests' prefix-cache hits, looked up once a step

    def _new_meters(self) -> tuple[ArrivalRate, OutputLengths]:
        """What the policy learns from traffic: the arrival rate and the output lengths, none seen yet."""
        c = self.config
        return ArrivalRate(c.rate_window_s, min_span_s=c.rate_min_span_s), OutputLengths(c.length_window)

    def _prefill_start(self, r: Request, scheduler: "Scheduler") -> int:
        """The position r's prefill still to compute starts at: its computed tokens once it runs; while it
        waits (none computed, or preempted), the tokens the prefix cache holds for it (a lookup that counts
        no query, once a step), which its admission will take instead of computing."""
        if r.status == RequestStatus.RUNNING:
            return r.num_computed_tokens
        start = self._cached_memo.get(r.request_id)
        if start is None:
            start = self._cached_memo[r.request_id] = scheduler.kv.get_computed_blocks(r)[1]
        return start

    @contextmanager
    def learning_paused(self):
        """Inside the block, arrivals and finished requests go to meters that are dropped after it: the
        arrival rate and the output lengths are as they were before it."""
        saved = self.arrivals, self.lengths
        self.arrivals, self.lengths = self._new_meters()
        try:
            yield
        finally:
            self.arrivals, self.lengths = saved
            self._mean_memo.clear()

    # ---- remaining output tokens ------------------------------------------------------------------------
    def request_finished(self, request: Request) -> None:
        if _stops_by_itself(request) and request.finish_reason != FinishReason.ERROR:
            self.lengths.record(request.num_output_tokens, request.finish_reason == FinishReason.STOP)
            self._mean_memo.clear()

    def _floor(self, r: Request) -> int:
        """Tokens r surely still produces: min_tokens masks its stops until then; at least 1."""
        return max(r.sampling_params.min_tokens - r.num_output_tokens, 1)

    def remaining_low(self, r: Request, cap: int) -> int:
        """A low estimate (horizon_quantile) of the output tokens r still produces, at most `cap`."""
        q = self.config.horizon_quantile
        return self._remaining(r, cap, lambda n, m: self.lengths.remaining_quantile(n, m, q))

    def remaining_mean(self, r: Request, cap: int) -> int:
        """The expected output tokens r still produces (rounded), at most `cap`."""
        key = (r.request_id, r.num_output_tokens, cap)
        value = self._mean_memo.get(key)
        if value is None:
            value = self._mean_memo[key] = self._remaining(
                r, cap, lambda n, m: round(self.lengths.expected_remaining(n, m)))
        return value

    def _remaining(self, r: Request, cap: int, estimate) -> int:
        """estimate(produced, max_tokens) for a request that may stop by itself, else exactly what max_tokens
        leaves; at least what min_tokens still forces (and 1), at most `cap`."""
        n = r.num_output_tokens
        value = estimate(n, r.max_tokens) if _stops_by_itself(r) else r.max_tokens - n
        return min(max(value, self._floor(r)), cap)

    # ---- the step's budget --------------------------------------------------------------------------
    def step_limit_s(self, running: list[Request], now: float, model, y: DecodeYield = PLAIN) -> float:
        """Predicted time this step may take (inf: no running request has a TPOT target). Each request with
        a target and a first token has an allowance, aim * (k + h) - elapsed, for k tokens after its first
        so far and h = its remaining tokens (low estimate) within horizon_steps steps, and a slack, what the
        allowance holds beyond the steady steps those tokens take (h / y.output_tokens of them, each
        steady_step_s of the running batch). It allows a steady step plus slack_spend of its slack
        (spending it all at once is right only if the steps after are as predicted: step times vary, and
        arrivals come), never less than a decode-only step, with drafts where they pay (_decode_only_s:
        decodes always run; prefill then gets its minimum chunk, drafts the rest: step_plan). The
        tightest request sets the limit, among those that decode-only steps (with drafts where they pay)
        could still keep on target: a steady step carries the batch's share of prefill, which this limit
        itself defers, so a request past the steady bar may still be kept; one past even the decode-only
        bar completes, counted, without slowing all."""
        return self.step_plan(running, now, model, y)[0]

    def step_plan(self, running: list[Request], now: float, model,
                  y: DecodeYield = PLAIN) -> tuple[float, float]:
        """step_limit_s, and the seconds of it kept for drafts (StepBudget.draft_reserve_s): what drafts add
        to the limit's floor (_decode_only_s), 0 where they do not pay or there is no limit. Prefill chunks
        are sized into the time beyond it, so a step held to its floor spends on prefill only the minimum
        chunk and on drafts the rest."""
        c, limit, reserve = self.config, math.inf, 0.0
        steady = decode = per_token = None
        for r in running:
            target = _tpot_s(r)
            if target is None or r.first_token_time is None:
                continue                      # no target, or still before its first token
            if steady is None:
                y, steady = self.plan_yield(running, model, y)
                cap = round(c.horizon_steps * y.output_tokens)
                decode, per_token, reserve = self._decode_only_s(running, model, y)
            h = self.remaining_low(r, cap)
            allowance = c.tpot_margin * target * (r.num_output_tokens - 1 + h) - (now - r.first_token_time)
            if allowance >= per_token * h:    # decode-only steps would keep it on target
                limit = min(limit, max(steady + c.slack_spend * (allowance - steady * h / y.output_tokens), decode))
        return limit, reserve

    def plan_yield(self, batch: list[Request], model, y: DecodeYield) -> tuple[DecodeYield, float]:
        """The yield to plan `batch`'s steps with, and its steady step (seconds): y where its drafts pay
        (steady steps with them take less time per output token than plain steps), else PLAIN. Drafts are
        granted last, from the time a step has left: a plan that counted drafts that do not pay would make
        room for them."""
        steady = self.steady_step_s(batch, model, y)
        if y == PLAIN:
            return y, steady
        plain = self.steady_step_s(batch, model)
        return (y, steady) if steady / y.output_tokens < plain else (PLAIN, plain)

    @staticmethod
    def _decode_only_s(running: list[Request], model, y: DecodeYield) -> tuple[float, float, float]:
        """The least step a time limit allows, the least time per output token of decode-only steps of
        `running`, and what drafts add to that least step (0 where they do not pay). Decodes always run, so the floor is at least a decode-only step without drafts; where
        drafts as y says take less time per output token, it is the step with them (if longer): a request
        behind its TPOT target gains from drafts that pay, and a floor that cut them would lengthen every
        running request's TPOT."""
        plain = model.predict(SLOPolicy._decode_only_step(running))
        if y == PLAIN:
            return plain, plain, 0.0
        positions = sum(q.num_tokens - 1 for q in running)
        drafted = model.predict(y.features(len(running), positions))
        if drafted / y.output_tokens < plain:
            return max(drafted, plain), drafted / y.output_tokens, max(drafted - plain, 0.0)
        return plain, plain, 0.0

    def begin_step(self, scheduler: "Scheduler", now: float) -> StepBudget:
        """The step's time limit is computed only if a grant asks for it (a prefill chunk or drafts): it costs
        O(running) Python, and most steps under load are decodes alone, which it never limits. Without a
        running TPOT target there is no limit (an Offline batch: its budget counts nothing)."""
        self._mean_memo.clear()                   # a new step: every running request has a new token
        self._cached_memo.clear()                 # and the prefix cache may have changed
        model, tokens = scheduler.step_model, scheduler.config.max_num_batched_tokens
        if not model.is_fitted or all(_tpot_s(r) is None for r in scheduler.running):
            return StepBudget(tokens)
        running, y = list(scheduler.running), decode_yield(scheduler)      # as they are when the step begins
        plan = functools.cache(lambda: self.step_plan(running, now, model, y))     # once, when first asked
        allowance = lambda: plan()[0] - model.coefficients["intercept"]
        return StepBudget(tokens, allowance, model, self.config.min_prefill_chunk, lambda: plan()[1])

    def running_order(self, running: list[Request]) -> list[Request]:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
        return decodes + [r for r in running if r.num_tokens - r.num_computed_tokens > 1]

    # ---- the waiting queue ----------------------------------------------------------------------------
    def add_waiting(self, waiting: deque[Request], request: Request) -> None:
        self.arrivals.add(request.arrival_time)
        super().add_waiting(waiting, request)

    def order_waiting(self, waiting: deque[Request], scheduler: "Scheduler", now: float) -> None:
        """Requests held max_hold_s first (by arrival), then those that can still meet their TTFT target,
        then those whose TTFT is lost (_ttft_lost); within each, least slack: TTFT deadline minus the
        predicted time of the prefill still to compute (now is common to all, so it drops out). Stable:
        equal keys keep arrival order."""
        if len(waiting) > 1:
            model = scheduler.step_model
            decode = self._decode_only_step(scheduler.running) if model.is_fitted else None

            def key(r: Request) -> tuple[int, float]:
                if now - r.arrival_time > self.config.max_hold_s:
                    return 0, r.arrival_time
                lost = decode is not None and self._ttft_lost(r, scheduler, now, decode)
                start = self._prefill_start(r, scheduler)
                return 2 if lost else 1, _deadline(r, self.config) - model.chunk_marginal(start, r.num_tokens - start)

            ranked = sorted(waiting, key=key)
            waiting.clear()
            waiting.extend(ranked)

    def _ttft_lost(self, r: Request, scheduler: "Scheduler", now: float, decode: StepFeatures) -> bool:
        """r has a TTFT target it can no longer meet: before its first token and past its TTFT allowance
        (even its whole remaining prefill in a step starting now would end past its deadline). decode: the
        running batch's decode-only step, computed once for the whole queue."""
        if r.sampling_params.ttft_target_ms is None or r.first_token_time is not None:
            return False
        whole_s = self._whole_prefill_step_s(r, scheduler, decode)[1]
        return now - r.arrival_time > self._ttft_allowance_s(r, scheduler, whole_s)

    def may_admit(self, request: Request, scheduler: "Scheduler", now: float) -> bool:
        running = scheduler.running
        model = scheduler.step_model
        batch = running + [request]
        if not running or not model.is_fitted or all(_tpot_s(r) is None for r in batch):
            return True
        y = decode_yield(scheduler)
        alone, steady = self.plan_yield([request], model, y)
        if steady / alone.output_tokens > self.config.tpot_margin * min(
                t for t in map(_tpot_s, batch) if t is not None):
            return True                       # not even one request alone meets it: serve for throughput
        if now - request.arrival_time > self.config.max_hold_s:
            return True                       # held long enough: nothing starves
        before, after = self.forecast(running, model, now, y), self.forecast(batch, model, now, y)
        aim = self.config.tpot_margin
        hold = (self.projected_tpot_s(request, after, now) > aim * (_tpot_s(request) or math.inf)
                or any(self._would_miss(r, before, after, aim, now) for r in running))
        return not (hold and self._hold_can_end(request, now, before))

    def forecast(self, batch: list[Request], model, now: float, y: DecodeYield = PLAIN) -> BatchForecast:
        """The batch over the coming steps if `batch` runs now (core/batch_forecast.py), in steps: a request
        stays for its remaining tokens' steps at y's yield."""
        y, steady = self.plan_yield(batch, model, y)
        intercept = model.coefficients["intercept"]
        cap = self._token_cap(y)
        steps = tuple(y.steps_for(self.remaining_mean(r, cap)) for r in batch)
        return BatchForecast(steps, self.arrivals.rate(now) * steady, sum(steps) / len(steps),
                             intercept, max(steady - intercept, 0.0) / len(batch), y)

    def _token_cap(self, y: DecodeYield) -> int:
        """A request's remaining tokens counted at most forecast_max_steps steps ahead."""
        return round(self.config.forecast_max_steps * y.output_tokens)

    def _would_miss(self, r: Request, before: BatchForecast, after: BatchForecast, margin: float,
                    now: float) -> bool:
        """Admission would turn r's projected TPOT from within margin * target to past it (a request
        already past it is not protected at everyone else's expense: it completes, counted)."""
        target = _tpot_s(r)
        if target is None:
            return False
        bar = margin * target
        return self.projected_tpot_s(r, before, now) <= bar < self.projected_tpot_s(r, after, now)

    def projected_tpot_s(self, r: Request, forecast: BatchForecast, now: float) -> float:
        """r's TPOT at its end by the forecast: its time since its first token plus its remaining steps'
        predicted time, over its tokens after the first (before its first token: the mean step ahead over
        the tokens a step yields)."""
        y = forecast.decode_yield
        remaining = self.remaining_mean(r, self._token_cap(y))
        steps = y.steps_for(remaining)
        if r.first_token_time is None:
            return forecast.mean_step_s(steps) / y.output_tokens
        return ((now - r.first_token_time) + forecast.time_s(steps)) / (r.num_output_tokens - 1 + remaining)

    def prefill_is_urgent(self, request: Request, scheduler: "Scheduler", now: float) -> bool:
        """Before its first token and past prefill_urgent_fraction of its TTFT allowance: its prefill takes
        the step's time beyond the limit, or its TTFT miss is certain."""
        if request.first_token_time is not None:
            return False
        return self._waited_past(request, scheduler, now, self.config.prefill_urgent_fraction)

    def prefill_floor(self, request: Request, scheduler: "Scheduler") -> int:
        """A prompt whose TTFT allowance is short against its own prefill (under whole_prefill_ttft_ratio
        times what the prefill adds to a decode-only step, the per-step prefill costs included) is not cut
        for the time limit: its pieces could not be spread far (past prefill_urgent_fraction of the
        allowance the rest goes whole anyway), each piece pays the per-step prefill costs, and spreading a
        prefill lowers no request's mean TPOT unless that request leaves within the spread, so cutting would
        spend TTFT and compute for little TPOT. Any other prompt with a TTFT target is cut into pieces no
        smaller than _overhead_chunk: a piece whose tokens cost little beside the per-step prefill costs it
        adds spends more compute on cutting than on the prompt (on this project's CPUs, int4: about 7 ms a
        piece against 0.12 ms a token), and the batch's TPOT pays for the throughput lost."""
        model = scheduler.step_model
        target = request.sampling_params.ttft_target_ms
        if target is None or request.first_token_time is not None or not model.is_fitted:
            return 0
        decode_s, whole_s = self._whole_prefill_step_s(request, scheduler)
        tight = self._ttft_allowance_s(request, scheduler, whole_s) < \
            self.config.whole_prefill_ttft_ratio * (whole_s - decode_s)
        remaining = request.num_tokens - self._prefill_start(request, scheduler)
        if tight:
            return remaining
        return min(remaining, self._overhead_chunk(model))

    def _overhead_chunk(self, model) -> int:
        """The smallest prefill piece whose tokens cost at least 1 / max_piece_overhead times the fixed cost
        a step pays for carrying prefill beside decodes (per_prefill_step + per_mixed_step)."""
        c = model.coefficients
        fixed, per_token = c["per_prefill_step"] + c["per_mixed_step"], c["per_prefill_token"]
        if per_token <= 0:
            return 1 << 30
        return math.ceil(fixed / (self.config.max_piece_overhead * per_token))

    def _waited_past(self, r: Request, scheduler: "Scheduler", now: float, fraction: float) -> bool:
        """r has waited more than `fraction` of its TTFT allowance (_ttft_allowance_s)."""
        return now - r.arrival_time > fraction * self._ttft_allowance_s(r, scheduler)

    def _ttft_allowance_s(self, r: Request, scheduler: "Scheduler", whole_s: float | None = None) -> float:
        """Seconds from r's arrival to the latest start of the step that computes the rest of its prompt
        whole and still ends by its TTFT deadline (that step, whole_s: a decode-only step of the running
        batch plus the chunk, as the step-time model predicts; computed here if not given). An allowance that
        ignored the prefill's own time would let a short TTFT target (or a long prompt) go urgent only when
        its miss is already certain."""
        allowance = _deadline(r, self.config) - r.arrival_time
        if scheduler.step_model.is_fitted:
            allowance -= self._whole_prefill_step_s(r, scheduler)[1] if whole_s is None else whole_s
        return max(allowance, 0.0)

    def _whole_prefill_step_s(self, r: Request, scheduler: "Scheduler",
                              decode: StepFeatures | None = None) -> tuple[float, float]:
        """Predicted seconds of a decode-only step of the running batch (`decode`, computed here if not
        given), and of that step with the rest of r's prompt added whole (what the prefix cache holds of
        it not counted: _prefill_start)."""
        model = scheduler.step_model
        decode = decode if decode is not None else self._decode_only_step(scheduler.running)
        start = self._prefill_start(r, scheduler)
        whole = decode.plus(model.chunk_features(start, r.num_tokens - start))
        return model.predict(decode), model.predict(whole)

    @staticmethod
    def _decode_only_step(running: list[Request]) -> StepFeatures:
        """A decode-only step of `running`, one token each."""
        return PLAIN.features(len(running), sum(q.num_tokens - 1 for q in running))

    def _hold_can_end(self, r: Request, now: float, before: BatchForecast) -> bool:
        """Holding r back can end in a smaller batch: a running request is forecast to leave before r has
        waited max_hold_s, when it is admitted regardless. Otherwise the batch it would join then is no
        smaller than now's, and holding it only spends its TTFT."""
        if not before.remaining:
            return True
        return before.time_s(before.remaining[0]) < self.config.max_hold_s - (now - r.arrival_time)

    def steady_step_s(self, batch: list[Request], model, y: DecodeYield = PLAIN) -> float:
        """Predicted step time once `batch` decodes together (each request's new tokens as y says) while
        carrying its share of prefill: as many prompt tokens per step as the batch's prompt-to-output ratio
        says keep arrivals and departures even at y.output_tokens output tokens a request per step (output:
        each request's tokens so far plus its expected remaining ones), each prompt whole in one step (so
        that share of prompts, at most 1, is the share of steps paying per_prefill_step)."""
        n = len(batch)
        prompt = sum(r.num_prompt_tokens for r in batch)
        output = sum(r.num_output_tokens + self.remaining_mean(r, r.max_tokens) for r in batch)
        prefill_per_step = n * y.output_tokens * prompt / output
        decode = y.features(n, sum(r.num_tokens - 1 for r in batch))
        reads = decode.context_reads + prefill_per_step * (prompt / n) / 2
        prefill_steps = max(min(prefill_per_step * n / prompt, 1.0), decode.prefill_steps)   # prompt >= n >= 1
        return model.predict(StepFeatures(decode.decode_rows, decode.prefill_tokens + round(prefill_per_step),
                                          round(reads), prefill_steps))

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: _deadline(r, self.config))
