"""How close to the step-time bound a Server run can come under Poisson arrivals and a TTFT limit.

The step-time bound (core/step_time.server_bound) is a rate: the output tokens/s of a batch held at the most
rows whose steps stay within the TPOT limit. Requests arriving by a Poisson process at a share rho of that
rate come in bursts; while the batch is full a burst waits, and its TTFT with it. `utilization_ceiling` is the
highest rho at which an engine doing what the bound assumes keeps the p99 TTFT within the limit, in the
median of seeded runs of the scenario's length (MLPerf's 600 s). That engine (`capped_fcfs_ttfts`):
- admits arrivals first come first served while fewer than `rows` requests are in the batch (and, given a
  token budget, while their whole prompts fit in it beside the step's decode rows: a prompt that does not
  fit waits a step, where the engine would start it in a chunk; the bound assumes no budget, and neither does
  the ceiling); a request's prompt runs in the first step that starts after it arrives (its first token comes
  at that step's end), then output_len - 1 decode steps;
- takes for every step what the fitted step-time model predicts for what the step computes (decode rows,
  prefill tokens, attention reads, the per-step prefill costs);
- runs requests all of the run's mean prompt and output lengths.
It is a model of the engine, not a bound on every scheduler: a policy may let the batch run past `rows` for a
while (a TPOT is a mean over a request's decode) or serve out of arrival order. What it shows is the scale:
the fewer rows a step holds within the TPOT limit (tens on a CPU at 100 ms, thousands on a GPU), the less of a
burst the batch absorbs, and the further below the bound the TTFT tail sets the ceiling.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from tokenmill.bench.scenarios import ServerScenario
from tokenmill.core.step_time import FEATURE_NAMES


def step_seconds(coefficients: dict, decode_rows: int, prefill_tokens: int, context_reads: int) -> float:
    """StepTimeModel.predict of a real step with this work, from its coefficients (plain float arithmetic:
    the simulation asks it every step)."""
    c = [coefficients.get(name, 0.0) for name in FEATURE_NAMES]
    prefill = 1.0 if prefill_tokens > 0 else 0.0
    return (c[0] + c[1] * decode_rows + c[2] * prefill_tokens + c[3] * context_reads + c[4] * prefill
            + c[5] * (prefill if decode_rows > 0 else 0.0))


def server_arrivals(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """The arrival times (s) of the bench's own Server scenario (ServerScenario: Poisson, seeded, until
    duration_s) at `rate` per second. The same seed draws the same exponential gaps at every rate, scaled by
    1 / rate, so runs at two rates differ only in their pace."""
    return np.array(ServerScenario(rate, duration_s, 0, seed=seed).arrival_times())


def capped_fcfs_ttfts(coefficients: dict, rows: int, prompt_len: int, output_len: int, arrivals: np.ndarray,
                      max_num_batched_tokens: int | None = None) -> np.ndarray:
    """TTFT (s) of each arrival (sorted times, s) in the engine the module docstring describes
    (max_num_batched_tokens: the step's token budget, None: none)."""
    p, d = int(prompt_len), max(int(output_len), 1)
    prompt_reads = p * (p + 1) // 2
    ttft = np.empty(arrivals.size)
    running: deque[int] = deque()    # admission steps of the requests in the batch, oldest first
    admitted_sum = 0                 # their sum
    t, step, i, n = 0.0, 0, 0, arrivals.size
    while i < n or running:
        while running and running[0] + d - 1 < step:          # its last token came in step running[0] + d - 1
            admitted_sum -= running.popleft()
        if not running and i < n and arrivals[i] > t:
            t = float(arrivals[i])                            # idle until the next arrival
        decoding = len(running)
        fits = rows
        if max_num_batched_tokens is not None:                # whole prompts within the budget, and one at
            fits = max((max_num_batched_tokens - decoding) // max(p, 1), 0 if decoding else 1)   # least alone
        new = 0
        while i + new < n and new < fits and decoding + new < rows and arrivals[i + new] <= t:
            new += 1
        # a request admitted at step s decodes position p + (step - s) - 1 now: it reads p + step - s keys
        reads = decoding * (p + step) - admitted_sum + new * prompt_reads
        t += step_seconds(coefficients, decoding, new * p, reads)
        for j in range(i, i + new):
            ttft[j] = t - arrivals[j]
            running.append(step)
        admitted_sum += new * step
        i += new
        step += 1
    return ttft


def utilization_ceiling(coefficients: dict, rows: int, prompt_len: int, output_len: int, bound_rate: float,
                        ttft_limit_s: float, duration_s: float = 600.0, runs: int = 9, quantile: float = 0.99,
                        tolerance: float = 0.005) -> float:
    """The highest rho in [0, 1] (to `tolerance`) at which arrivals at rho * bound_rate requests/s keep the
    median over `runs` seeded runs of the `quantile` TTFT within ttft_limit_s (0: not even the lightest load,
    1: the whole bound). The same seeds at every rho, so the search may bisect."""
    if rows < 1 or bound_rate <= 0 or ttft_limit_s <= 0 or duration_s <= 0 or runs < 1:
        raise ValueError(f"utilization_ceiling: need rows >= 1 and bound_rate, ttft_limit_s, duration_s, runs > 0; "
                         f"got {rows}, {bound_rate}, {ttft_limit_s}, {duration_s}, {runs}")

    def passes(rho: float) -> bool:
        tails = []
        for seed in range(runs):
            arrivals = server_arrivals(rho * bound_rate, duration_s, seed)
            ttft = capped_fcfs_ttfts(coefficients, rows, prompt_len, output_len, arrivals)
            tails.append(float(np.quantile(ttft, quantile, method="inverted_cdf")) if ttft.size else 0.0)
        return float(np.median(tails)) <= ttft_limit_s

    if passes(1.0):
        return 1.0
    low, high = 0.0, 1.0
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if passes(mid) else (low, mid)
    return low


MAX_ARRIVALS = 200_000      # a run's expected arrivals past which no ceiling is simulated (a run costs about
                            # a microsecond of Python per step and arrival)


def bound_ceiling(coefficients: dict, bound: dict, ttft_limit_ms: float | None, replicas: int = 1,
                  duration_s: float = 600.0) -> dict | None:
    """The queueing ceiling of one replica's step-time bound (server_bound's dict: rows, tokens_per_s,
    prompt_len, output_len): None without a TTFT limit, a whole finite number of rows, or with more than
    MAX_ARRIVALS a run at the bound (a model that prices rows at nearly nothing). Replicas reached by random
    routing each see a Poisson share of the arrivals, so one replica's ceiling is theirs together."""
    if not ttft_limit_ms or not math.isfinite(bound["rows"]) or not bound["rows"] >= 1 \
            or not math.isfinite(bound["tokens_per_s"]) or not bound["tokens_per_s"] > 0:
        return None
    rows = int(bound["rows"])
    prompt_len, output_len = round(bound["prompt_len"]), max(round(bound["output_len"]), 1)
    rate = bound["tokens_per_s"] / output_len                 # requests/s at the bound
    if rate * duration_s > MAX_ARRIVALS:
        return None
    ceiling = utilization_ceiling(coefficients, rows, prompt_len, output_len, rate, ttft_limit_ms / 1e3,
                                  duration_s)
    return {"utilization": ceiling, "rows": rows, "replicas": replicas, "ttft_limit_ms": ttft_limit_ms,
            "duration_s": duration_s}
