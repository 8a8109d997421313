"""A simulated engine for scheduling-policy tests: the real Scheduler and KV manager, a simulated clock, and
a fake model whose step time is a known linear function of the step's features (no tensors). With
speculation (SimSpeculation), every decoding request drafts k tokens a step (k chosen each step by the
engine's adaptive draft length, or fixed) and each draft is accepted with probability alpha, in order, until
the first rejection."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.core.decode_yield import DecodeYieldMeter
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.messages import RunnerOutput
from tokenmill.core.policy import SchedulingPolicy, make_policy
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_time import PER_OP, DecodeRows, StepTimeModel, step_features
from tokenmill.spec.adaptive import AdaptiveDraftLength
from tokenmill.sampling_params import SamplingParams

# seconds per unit: the fake model's true costs
TRUE_COSTS = {"intercept": 0.010, "per_decode_row": 0.005, "per_prefill_token": 0.001, "per_context_read": 1e-7}


@dataclass
class Arrival:
    time_s: float
    prompt_len: int
    output_len: int
    ttft_target_ms: float | None = 2000.0
    tpot_target_ms: float | None = 50.0
    max_tokens: int | None = None     # None: exactly output_len tokens (ignore_eos); else EOS after output_len


@dataclass(frozen=True)
class SimSpeculation:
    k: int                            # drafts a decoding request brings each step (fewer near max_tokens)
    alpha: float                      # each draft's acceptance probability, given the ones before it
    seed: int = 0
    adaptive: bool = True             # k per step by spec/adaptive.py (False: always k)
    measure_yield: bool = True        # False: the scheduler measures no decode yield (policies assume PLAIN)


@dataclass
class SimResult:
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_s: dict[str, float] = field(default_factory=dict)
    num_output: dict[str, int] = field(default_factory=dict)
    step_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    targets: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    model: StepTimeModel | None = None        # the policy's step-time model after the run

    def p99(self, values) -> float:
        v = sorted(values)
        return v[min(int(len(v) * 0.99), len(v) - 1)]

    def met(self, rid: str) -> bool:
        ttft, tpot = self.targets[rid]
        return ((ttft is None or self.ttft_s[rid] * 1e3 <= ttft)
                and (tpot is None or self.tpot_s.get(rid, 0.0) * 1e3 <= tpot))


def poisson_arrivals(qps: float, n: int, prompt_len: int, output_len: int, seed: int = 0, **targets) -> list[Arrival]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(qps)
        out.append(Arrival(t, prompt_len, output_len, **targets))
    return out


EOS = 2


def true_step_s(features, costs=TRUE_COSTS) -> float:
    """The fake platform's step time: linear in the features (a step with prefill tokens pays
    costs["per_prefill_step"], and costs["per_mixed_step"] beside decode rows, where given, as leaving a
    fused decode program does on this project's CPUs)."""
    return StepTimeModel(prior=costs).predict(features)


def _propose(s: Scheduler, k: int) -> None:
    """Up to k drafts for each running request whose next step is a decode (as EngineCore._propose gives
    them)."""
    for r in s.running:
        room = min(k, r.max_tokens - r.num_output_tokens - 1)
        decoding = r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1
        r.spec_token_ids = [5] * room if decoding and room > 0 else []


def _observe_speculation(adaptive: AdaptiveDraftLength, out, produced, k: int, seconds: float) -> None:
    """What EngineCore feeds the adaptive draft length: each drafted request's acceptance, and the step's
    tokens and seconds when it was all decodes, each with the drafts it brought."""
    for sr in out.scheduled:
        if sr.num_draft_tokens:
            adaptive.observe_request(sr.num_draft_tokens, produced[sr.request_id] - 1)
    if not out.num_requests_drafts_withheld and \
            all(sr.num_new_tokens - sr.num_draft_tokens == 1 and sr.output_token_ids for sr in out.scheduled):
        adaptive.observe_step(k, len(out.scheduled), seconds, sum(produced.values()))


def _sampled(r: Request, output_len: int, num_drafts: int, spec: SimSpeculation | None, rng) -> list[int]:
    """The fake model's tokens for r's step: 1 + its accepted drafts, EOS as its output_len-th token."""
    accepted = 0
    while accepted < num_drafts and rng.random() < spec.alpha:
        accepted += 1
    n = r.num_output_tokens
    return [EOS if n + j + 1 >= output_len else 5 for j in range(accepted + 1)]


def simulate(arrivals: list[Arrival], policy: "str | SchedulingPolicy", max_num_seqs: int = 256, budget: int = 2048,
             num_blocks: int = 4096, block_size: int = 16, prior: dict | None = TRUE_COSTS,
             costs: dict = TRUE_COSTS, max_steps: int = 200_000, speculation: SimSpeculation | None = None,
             rows: DecodeRows = PER_OP) -> SimResult:
    """rows: which steps the fake platform runs as decode rows (its costs and the policy's model both)."""
    clock = [0.0]
    model = StepTimeModel(prior=prior, rows=rows)
    s = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len=1 << 16),
                  KVCacheManager(num_blocks, block_size, False), make_policy(policy) if isinstance(policy, str) else policy, model,
                  clock=lambda: clock[0])
    if speculation is not None and speculation.measure_yield:
        s.decode_yield = DecodeYieldMeter()
    rng = random.Random(speculation.seed if speculation else 0)
    adaptive = AdaptiveDraftLength(speculation.k) if speculation is not None and speculation.adaptive else None
    k = speculation.k if speculation is not None else 0
    res, pending = SimResult(), sorted(arrivals, key=lambda a: a.time_s)
    first, last, reqs, lengths = {}, {}, {}, {}
    i = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i].time_s <= clock[0]:
            a = pending[i]
            rid = f"r{i}"
            if a.max_tokens is None:
                params = SamplingParams(max_tokens=a.output_len, min_tokens=a.output_len, ignore_eos=True,
                                        ttft_target_ms=a.ttft_target_ms, tpot_target_ms=a.tpot_target_ms)
            else:
                params = SamplingParams(max_tokens=a.max_tokens, ttft_target_ms=a.ttft_target_ms,
                                        tpot_target_ms=a.tpot_target_ms)
            reqs[rid] = Request(rid, [7] * a.prompt_len, params, eos_token_ids=(EOS,), arrival_time=a.time_s)
            lengths[rid] = a.output_len
            res.targets[rid] = (a.ttft_target_ms, a.tpot_target_ms)
            s.add_request(reqs[rid])
            i += 1
        if s.num_unfinished == 0:
            if i == len(pending):
                break
            clock[0] = pending[i].time_s                  # idle until the next arrival
            continue
        if speculation is not None:
            if adaptive is not None:
                k = adaptive.choose(model, [r.num_tokens - 1 for r in s.running
                                            if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1])
            _propose(s, k)
        out = s.schedule()
        features = step_features(out, rows)
        dt = true_step_s(features, costs)
        clock[0] += dt
        res.step_times_s.append(dt)
        model.observe(features, dt)
        sampled = {sr.request_id: _sampled(reqs[sr.request_id], lengths[sr.request_id], sr.num_draft_tokens,
                                           speculation, rng) for sr in out.scheduled if sr.sample}
        if adaptive is not None:
            _observe_speculation(adaptive, out, {rid: len(ids) for rid, ids in sampled.items()}, k, dt)
        s.update(out, RunnerOutput(sampled))
        for sr in out.scheduled:
            r = reqs[sr.request_id]
            if sr.sample:
                first.setdefault(sr.request_id, clock[0])
                last[sr.request_id] = clock[0]
                res.num_output[sr.request_id] = r.num_output_tokens
    else:
        raise AssertionError("simulation did not finish")
    for rid, r in reqs.items():
        res.ttft_s[rid] = first[rid] - r.arrival_time
        n = res.num_output[rid]
        if n > 1:
            res.tpot_s[rid] = (last[rid] - first[rid]) / (n - 1)
    res.end_s, res.model = clock[0], model
    return res
