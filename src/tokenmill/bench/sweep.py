"""sweep: closed-loop concurrency sweep; total tokens/s against per-user tokens/s (1000 / TPOT ms),
the Pareto frontier of the two, as a CSV and a PNG."""
from __future__ import annotations

import csv
from pathlib import Path

from tokenmill.bench.scenarios import ConcurrencyScenario
from tokenmill.bench.session import BenchSession, Outcome


def sweep_point(o: Outcome) -> dict:
    m = o.result.metrics
    return {"concurrency": o.result.concurrency, "tokens_per_s": m.completed_tokens_per_s or 0.0,
            "per_user_tokens_per_s": m.per_user_tokens_per_s or 0.0, "tpot_p50_ms": m.tpot_ms.get("p50"),
            "tpot_p99_ms": m.tpot_ms.get("p99"), "ttft_p99_ms": m.ttft_ms.get("p99"),
            "request_throughput_rps": m.request_throughput_rps, "failed": m.num_failed, "verdict": o.verdict.label}


def pareto_frontier(points: list[dict]) -> list[dict]:
    """Points no other point beats on both per-user tokens/s and total tokens/s, by per-user tokens/s."""
    ordered = sorted(points, key=lambda p: (-p["per_user_tokens_per_s"], -p["tokens_per_s"]))
    frontier, best_y = [], float("-inf")
    for p in ordered:                       # descending x: keep points that raise the best y so far
        if p["tokens_per_s"] > best_y:
            frontier.append(p)
            best_y = p["tokens_per_s"]
    return sorted(frontier, key=lambda p: p["per_user_tokens_per_s"])


async def run_sweep(session: BenchSession, concurrencies: list[int], queries_per_level: int | None,
                    seed: int = 0) -> tuple[list[Outcome], list[dict], list[dict]]:
    """One closed-loop run per concurrency (queries_per_level default: 4 x concurrency, at least 8)."""
    outcomes = []
    for c in concurrencies:
        n = queries_per_level or max(8, 4 * c)
        outcomes.append(await session.run(ConcurrencyScenario(c, n, seed), label=f"Concurrency {c}", prefix=f"c{c}"))
    points = [sweep_point(o) for o in outcomes]
    return outcomes, points, pareto_frontier(points)


def write_sweep_csv(points: list[dict], frontier: list[dict], path: Path) -> Path:
    on_frontier = {id(p) for p in frontier}
    keys = list(points[0].keys()) + ["pareto"] if points else ["pareto"]
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for p in points:
            w.writerow({**p, "pareto": id(p) in on_frontier})
    return path
