"""What a step trace (TOKENMILL_STEP_TRACE=FILE, engine/step_trace.py) says: its step periods grouped by decode
rows (buckets of --bucket rows) and by whether the step carried prefill tokens, with the median period, the
step-time model's median prediction, and the median prefill tokens and running requests of each group; then
the model's median relative error and the share of the traced time spent in steps that carried prefill (what
a decoding request's TPOT pays for other requests' prompts). Asserts nothing.

    .venv/bin/python benchmarks/step_trace_summary.py TRACE.jsonl [--bucket 16] [--pid PID] [--since-s 0]
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def read_trace(path: str, pid: int | None = None, since_s: float = 0.0) -> list[dict]:
    """The trace's lines (one engine core's with `pid`), from since_s seconds after it opened."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [r for r in lines if (pid is None or r["pid"] == pid) and r["t"] >= since_s]


def summarize(lines: list[dict], bucket: int = 16) -> dict:
    """{"groups": [{rows_from, rows_to, with_prefill, steps, period_ms, predicted_ms, prefill_tokens, running}],
    "median_relative_error", "prefill_time_share", "steps", "seconds"}; medians throughout, periods in ms.
    The relative error is |predicted - period| / period over steps the model had a prediction for (> 0)."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1 decode row, got {bucket}")
    groups = defaultdict(list)
    for r in lines:
        groups[(r["decode_rows"] // bucket, r["prefill_tokens"] > 0)].append(r)
    rows = []
    for (b, with_prefill), members in sorted(groups.items()):
        med = lambda key, scale=1.0: scale * statistics.median(m[key] for m in members)
        rows.append({"rows_from": b * bucket, "rows_to": b * bucket + bucket - 1, "with_prefill": with_prefill,
                     "steps": len(members), "period_ms": med("seconds", 1e3), "predicted_ms": med("predicted", 1e3),
                     "prefill_tokens": med("prefill_tokens"), "running": med("running")})
    errors = [abs(r["predicted"] - r["seconds"]) / r["seconds"] for r in lines
              if r["predicted"] > 0 and r["seconds"] > 0]
    total = sum(r["seconds"] for r in lines)
    prefill = sum(r["seconds"] for r in lines if r["prefill_tokens"] > 0)
    return {"groups": rows, "median_relative_error": statistics.median(errors) if errors else None,
            "prefill_time_share": prefill / total if total > 0 else None, "steps": len(lines), "seconds": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--bucket", type=int, default=16, help="decode rows per group")
    ap.add_argument("--pid", type=int, default=None, help="one engine core's lines (data-parallel replicas)")
    ap.add_argument("--since-s", type=float, default=0.0, help="skip the first seconds (start-up, calibration)")
    args = ap.parse_args()
    s = summarize(read_trace(args.trace, args.pid, args.since_s), args.bucket)
    print("| decode rows | with prefill | steps | period ms | predicted ms | prefill tokens | running |")
    print("|---|---|---|---|---|---|---|")
    for g in s["groups"]:
        print(f"| {g['rows_from']}-{g['rows_to']} | {'yes' if g['with_prefill'] else 'no'} | {g['steps']} | "
              f"{g['period_ms']:.1f} | {g['predicted_ms']:.1f} | {g['prefill_tokens']:.0f} | {g['running']:.0f} |")
    err, share = s["median_relative_error"], s["prefill_time_share"]
    print(f"{s['steps']} steps over {s['seconds']:.1f} s; the model's median relative error "
          f"{'n/a' if err is None else f'{err:.1%}'}; steps with prefill took "
          f"{'n/a' if share is None else f'{share:.1%}'} of the time")


if __name__ == "__main__":
    main()
