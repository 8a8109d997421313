"""`tokenmill tune --profile P [--model M --quantization Q ...]`: find-peak trials over engine settings
(search.py), a table of the trials with a progress bar, and the best settings written to a config file that
`tokenmill serve --config FILE` and `LLM(config=FILE)` read."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

from tokenmill.tune.search import DEFAULT_SPACE, Trial, coordinate_search, parse_space


def add_tune_parser(subparsers) -> None:
    from tokenmill.bench.cli import _add_common
    p = subparsers.add_parser("tune", help="search engine settings for the highest Server peak QPS; writes a config file")
    _add_common(p, report=False)           # no report is written: none of its options
    g = p.add_argument_group("search")
    g.add_argument("--space", action="append", default=None, metavar="KNOB=V1,V2",
                   help="a knob and its values (repeatable; default: " +
                        "; ".join(f"{k}={','.join(map(str, v))}" for k, v in DEFAULT_SPACE.items()) + ")")
    g.add_argument("--max-trials", type=int, default=None, help="at most this many trials, >= 1 (default: no cap)")
    g.add_argument("--time-budget-s", type=float, default=None, help="no new trial starts after this")
    g.add_argument("--start-qps", type=float, default=0.25, help="first trial's find-peak lower bound")
    g.add_argument("--precision", type=float, default=0.1)
    g.add_argument("--max-runs", type=int, default=8, help="Server runs per trial's find-peak")
    g.add_argument("--max-query-count", type=int, default=None)
    g.add_argument("--out", default="tokenmill-tuned.json",
                   help="config file to write the best settings to (its directory must exist and be writable)")
    p.set_defaults(func=cmd_tune)


def _measure(base_cfg, ns):
    from tokenmill.bench.find_peak import PeakSearchConfig, find_peak
    from tokenmill.bench.session import BenchSession
    best = {"qps": None}

    def measure(settings: dict) -> Trial:
        t0 = time.perf_counter()
        start = max(ns.start_qps, 0.6 * best["qps"]) if best["qps"] else ns.start_qps
        search = PeakSearchConfig(start, ns.precision, ns.max_runs, min_duration_s=base_cfg.profile.min_duration_s,
                                  min_query_count=base_cfg.profile.server_min_query_count,
                                  max_query_count=ns.max_query_count, seed=ns.seed)

        async def go():
            cfg = dataclasses.replace(base_cfg, engine_args=dataclasses.replace(base_cfg.engine_args, **settings),
                                      progress=False)
            async with BenchSession(cfg) as session:
                return await find_peak(session, search)
        try:
            peak = asyncio.run(go())
        except (ValueError, TypeError, RuntimeError, OSError) as e:     # a setting the engine refuses, ...
            return Trial(settings, None, None, False, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
        tps = peak.peak.result.metrics.completed_tokens_per_s if peak.peak else None
        if peak.peak_qps and (best["qps"] is None or peak.peak_qps > best["qps"]):
            best["qps"] = peak.peak_qps
        return Trial(settings, peak.peak_qps, tps, peak.confirmed, time.perf_counter() - t0)
    return measure


def trial_table(trials: list[Trial], best: Trial | None):
    from rich.table import Table
    knobs = list(trials[0].settings) if trials else []
    table = Table(title="tokenmill tune: trials")
    for col in ["#"] + knobs + ["peak QPS", "tok/s at peak", "confirmed", "s", "best"]:
        table.add_column(col)
    for i, t in enumerate(trials, 1):
        peak = "error: " + t.error[:40] if t.error else ("none" if t.peak_qps is None else f"{t.peak_qps:.4g}")
        table.add_row(str(i), *[str(t.settings[k]) for k in knobs], peak,
                      "" if t.completed_tokens_per_s is None else f"{t.completed_tokens_per_s:.1f}",
                      "yes" if t.confirmed else "no", f"{t.seconds:.0f}", "*" if t is best else "")
    return table


def check_options(ns: argparse.Namespace) -> None:
    """What can be refused before the first trial: --max-trials, and an --out that could not be written
    after the search."""
    if ns.max_trials is not None and ns.max_trials < 1:
        raise ValueError(f"--max-trials must be >= 1 (leave it out for no cap), got {ns.max_trials}")
    check_out(ns.out)


def check_out(path: str) -> None:
    """--out names a file whose directory exists and is writable."""
    if os.path.isdir(path):
        raise ValueError(f"--out {path!r} is a directory; expected the config file's path, e.g. "
                         f"{os.path.join(path, 'tokenmill-tuned.json')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path!r}: its directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path!r}: its directory {folder!r} is not writable")


def cmd_tune(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from tokenmill.bench.cli import config_from_args
    from tokenmill.config_file import write_config
    if ns.url:
        print("tokenmill tune: error: tune runs the engine in-process; --url is not supported", file=sys.stderr)
        return 2
    try:
        check_options(ns)
        space = parse_space(ns.space)
        base = config_from_args(ns)
    except ValueError as e:
        print(f"tokenmill tune: error: {e}", file=sys.stderr)
        return 2
    console = Console()
    measure = _measure(base, ns)
    with Progress(console=console, disable=not ns.progress) as progress:
        task = progress.add_task("trials", total=ns.max_trials or sum(len(v) for v in space.values()))

        def on_trial(t: Trial) -> None:
            progress.advance(task)
            progress.console.print(f"trial {dict(t.settings)}: peak QPS {t.peak_qps} "
                                   f"({'error: ' + t.error if t.error else 'ok'}) in {t.seconds:.0f} s")
        result = coordinate_search(space, measure, ns.max_trials, ns.time_budget_s, on_trial)
    console.print(trial_table(result.trials, result.best))
    if result.best is None or result.best.peak_qps is None:
        console.print("No trial met the limits: no config file written (lower --start-qps).")
        return 1
    defaults = {f.name: f.default for f in dataclasses.fields(base.engine_args)}
    args = {k: v for k, v in dataclasses.asdict(base.engine_args).items() if v != defaults[k]}
    args.update(result.best.settings)
    tuned = {"profile": base.profile.name, "peak_qps": result.best.peak_qps,
             "completed_tokens_per_s": result.best.completed_tokens_per_s, "confirmed": result.best.confirmed,
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "stopped_early": result.stopped_early,
             "trials": [dataclasses.asdict(t) for t in result.trials]}
    path = write_config(ns.out, args, tuned)
    console.print(f"best: {result.best.settings} at {result.best.peak_qps:.4g} QPS; written to {path} "
                  f"(tokenmill serve --config {path})")
    return 0
