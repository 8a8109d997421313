"""The SLO policy (`scheduling_policy="slo"`): steps sized to the latency targets, by the step-time model.

MLPerf judges a request by its TTFT (arrival to first token) and its TPOT, the mean gap between its later
tokens. So, per step:
- time limit: the tightest allowance of the running requests that have a TPOT target: margin * target, plus
  what the request has banked by running ahead of its target so far (capped); requests already behind do
  not shrink the step (they cannot be helped without slowing everyone, and still complete, counted);
- running decodes first (one token each, always), then prefill chunks sized into the time left;
- waiting requests by least slack against their TTFT deadline (arrival + target, or + default_ttft_s for
  requests without one: the deadline ages them, so nothing starves);
- admission stops when the decode batch with one more request, plus the prefill work each step must carry
  to keep up (prompt tokens per output token of the running mix), would take some request's projected TPOT
  (its time so far plus its remaining tokens at that step time) past margin * target; slack a request has
  banked by running ahead admits more. Unless even one request alone would miss: then no batch meets the
  target, and admission serves throughput.
It drops nothing: a request that cannot meet its target still runs to completion.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.core.policy import SchedulingPolicy, StepBudget, register_policy
from tokenmill.core.request import Request
from tokenmill.core.step_time import StepFeatures, chunk_features

if TYPE_CHECKING:
    from tokenmill.core.scheduler import Scheduler


@dataclass(frozen=True)
class SLOPolicyConfig:
    tpot_margin: float = 0.95         # steps aim at this fraction of the TPOT target
    max_bank_steps: float = 4.0       # banked slack counts up to this many targets
    default_ttft_s: float = 10.0      # TTFT deadline of requests without a target (aging)
    min_prefill_chunk: int = 16       # tokens a step's first prefill chunk may take past the time limit


def _tpot_s(r: Request) -> float | None:
    t = r.sampling_params.tpot_target_ms
    return None if t is None else t / 1e3


def _deadline(r: Request, cfg: SLOPolicyConfig) -> float:
    t = r.sampling_params.ttft_target_ms
    return r.arrival_time + (cfg.default_ttft_s if t is None else t / 1e3)


@register_policy
class SLOPolicy(SchedulingPolicy):
    name = "slo"
    needs_step_model = True

    def __init__(self, config: SLOPolicyConfig | None = None) -> None:
        self.config = config or SLOPolicyConfig()

    # ---- the step's budget --------------------------------------------------------------------------
    def step_limit_s(self, running: list[Request], now: float) -> float:
        """Predicted step time the running requests' TPOT targets allow (inf: none has a target)."""
        c, limit = self.config, math.inf
        for r in running:
            target = _tpot_s(r)
            if target is None or r.first_token_time is None:
                continue                      # no target, or still before its first token
            aim = c.tpot_margin * target
            bank = aim * (r.num_output_tokens - 1) - (now - r.first_token_time)
            limit = min(limit, aim + min(max(bank, 0.0), c.max_bank_steps * aim))
        return limit

    def begin_step(self, scheduler: "Scheduler", now: float) -> StepBudget:
        model = scheduler.step_model
        limit = self.step_limit_s(scheduler.running, now)
        if not math.isfinite(limit) or not model.is_fitted:
            return StepBudget(scheduler.config.max_num_batched_tokens)
        return StepBudget(scheduler.config.max_num_batched_tokens, limit - model.coefficients["intercept"],
                          model, self.config.min_prefill_chunk)

    def running_order(self, running: list[Request]) -> list[Request]:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
        return decodes + [r for r in running if r.num_tokens - r.num_computed_tokens > 1]

    # ---- the waiting queue ----------------------------------------------------------------------------
    def add_waiting(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def readmit(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def order_waiting(self, waiting: deque[Request], scheduler: "Scheduler", now: float) -> None:
        """Least slack first: TTFT deadline minus the predicted time of the prefill still to compute (now is
        common to all, so it drops out). Stable: equal slack keeps arrival order."""
        if len(waiting) > 1:
            model = scheduler.step_model
            ranked = sorted(waiting, key=lambda r: _deadline(r, self.config) - model.marginal(
                chunk_features(0, r.num_tokens)))
            waiting.clear()
            waiting.extend(ranked)

    def may_admit(self, request: Request, scheduler: "Scheduler", now: float) -> bool:
        running = scheduler.running
        model = scheduler.step_model
        batch = running + [request]
        if not running or not model.is_fitted or all(_tpot_s(r) is None for r in batch):
            return True
        if self.steady_step_s([request], model) > self.config.tpot_margin * min(
                t for t in map(_tpot_s, batch) if t is not None):
            return True                       # not even one request alone meets it: serve for throughput
        step = self.steady_step_s(batch, model)
        return all(self.projected_tpot_s(r, step, now) <= self.config.tpot_margin * _tpot_s(r)
                   for r in batch if _tpot_s(r) is not None)

    @staticmethod
    def projected_tpot_s(r: Request, step_s: float, now: float) -> float:
        """r's TPOT at its end if every step from now on takes step_s: time since its first token plus its
        remaining tokens at step_s, over its tokens after the first (a request before its first token: step_s)."""
        remaining = max(r.max_tokens - r.num_output_tokens, 0)
        if r.first_token_time is None or r.num_output_tokens + remaining <= 1:
            return step_s
        return ((now - r.first_token_time) + step_s * remaining) / (r.num_output_tokens - 1 + remaining)

    @staticmethod
    def steady_step_s(batch: list[Request], model) -> float:
        """Predicted step time once `batch` decodes together while carrying its share of prefill: as many
        prompt tokens per step as the batch's prompt-to-output ratio says keep arrivals and departures even."""
        rows = len(batch)
        prompt = sum(r.num_prompt_tokens for r in batch)
        output = sum(max(r.max_tokens, 1) for r in batch)
        prefill_per_step = rows * prompt / output
        context = sum(r.num_tokens for r in batch)
        mean_prompt = prompt / rows
        reads = context + prefill_per_step * mean_prompt / 2
        return model.predict(StepFeatures(rows, round(prefill_per_step), round(reads)))

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: _deadline(r, self.config))
