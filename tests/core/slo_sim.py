"""A simulated engine for scheduling-policy tests: the real Scheduler and KV manager, a simulated clock, and
a fake model whose step time is a known linear function of the step's features (no tensors)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokenmill.config import SchedulerConfig
from tokenmill.core.kv_cache.manager import KVCacheManager
from tokenmill.core.messages import RunnerOutput
from tokenmill.core.policy import SchedulingPolicy, make_policy
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.step_time import StepTimeModel, step_features
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


def _token(r: Request, output_len: int) -> int:
    """The fake model's next token: EOS as r's output_len-th token, 5 before."""
    return EOS if r.num_output_tokens + 1 >= output_len else 5


def true_step_s(features, costs=TRUE_COSTS) -> float:
    return StepTimeModel(prior=costs).predict(features)


def simulate(arrivals: list[Arrival], policy: "str | SchedulingPolicy", max_num_seqs: int = 256, budget: int = 2048,
             num_blocks: int = 4096, block_size: int = 16, prior: dict | None = TRUE_COSTS,
             costs: dict = TRUE_COSTS, max_steps: int = 200_000) -> SimResult:
    clock = [0.0]
    model = StepTimeModel(prior=prior)
    s = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len=1 << 16),
                  KVCacheManager(num_blocks, block_size, False), make_policy(policy) if isinstance(policy, str) else policy, model,
                  clock=lambda: clock[0])
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
        out = s.schedule()
        dt = true_step_s(step_features(out), costs)
        clock[0] += dt
        res.step_times_s.append(dt)
        model.observe(step_features(out), dt)
        s.update(out, RunnerOutput({sr.request_id: [_token(reqs[sr.request_id], lengths[sr.request_id])]
                                    for sr in out.scheduled if sr.sample}))
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
