"""The four bench workflows on a `BenchSession`; each returns (outcomes, Markdown sections, summary)."""
from __future__ import annotations

from pathlib import Path

from tokenmill.bench import plots
from tokenmill.bench.find_peak import PeakSearchConfig, find_peak
from tokenmill.bench.scenarios import OfflineScenario, ServerScenario
from tokenmill.bench.session import BenchConfig, BenchSession, Outcome
from tokenmill.bench.sweep import run_sweep, write_sweep_csv
from tokenmill.bench.verdict import server_offline_ratio


def _fmt(v, d=2) -> str:
    return "n/a" if v is None else (f"{v:,.{d}f}" if isinstance(v, float) else str(v))


def ratio_section(server: Outcome | None, offline: Outcome | None) -> tuple[list[str], float | None]:
    ratio = server_offline_ratio(server.result if server else None, offline.result if offline else None)
    if ratio is None:
        return [], None
    return [f"**Server/Offline ratio: {ratio:.1%}** (Server completed tokens/s "
            f"{_fmt(server.result.metrics.completed_tokens_per_s)} at {server.result.target_qps:g} QPS vs Offline "
            f"tokens/s {_fmt(offline.result.metrics.tokens_per_s)}; Server verdict {server.verdict.label})", ""], ratio


def step_time_bound(server: Outcome | None, tpot_limit_ms: float | None,
                    ttft_limit_ms: float | None = None) -> dict | None:
    """What the engine's step-time model (after the run) says is the best completed tokens/s with every step
    within the TPOT limit, for this run's mean prompt and output lengths (core.step_time.server_bound): one
    replica's bound times the data-parallel replicas that each run such steps. With a TTFT limit, also its
    queueing ceiling (bench/queueing.py): the share of the bound a batch capped at its rows serves within
    that limit under Poisson arrivals, in 600 s runs."""
    model = server.extra.get("step_time_model") if server else None
    done = [r for r in server.result.records if r.ok] if server else []
    if not model or not done or not tpot_limit_ms:
        return None
    from tokenmill.bench.queueing import bound_ceiling
    from tokenmill.core.step_time import StepTimeModel, server_bound
    prompt = sum(r.num_prompt_tokens or 0 for r in done) / len(done)
    output = sum(r.num_output_tokens for r in done) / len(done)
    bound = server_bound(StepTimeModel(prior=model["coefficients"]), prompt, output, tpot_limit_ms / 1e3)
    replicas = int(model.get("replicas", 1))
    bound["queueing_ceiling"] = bound_ceiling(model["coefficients"], bound, ttft_limit_ms, replicas)
    for key in ("rows", "tokens_per_s", "unbounded_batch_tokens_per_s"):
        bound[key] *= replicas
    bound["replicas"] = replicas
    reached = server.result.metrics.completed_tokens_per_s
    bound["fraction_reached"] = reached / bound["tokens_per_s"] if reached and bound["tokens_per_s"] else None
    return bound


def bound_section(bound: dict | None) -> list[str]:
    if bound is None:
        return []
    replicas = bound.get("replicas", 1)
    each = f" in each of {replicas} replicas" if replicas > 1 else ""
    return [f"**Step-time bound: {_fmt(bound['tokens_per_s'])} tokens/s** ({bound['rows'] / replicas:.1f} decode "
            f"rows per {1e3 * bound['step_s']:.0f} ms step{each}, each carrying its share of "
            f"{bound['prompt_len']:.0f}-token prefills, for {bound['output_len']:.0f}-token outputs; an unbounded batch would allow "
            f"{_fmt(bound['unbounded_batch_tokens_per_s'])}). The Server run reached "
            f"{_fmt(100 * bound['fraction_reached'] if bound['fraction_reached'] else None, 1)}% of it.", ""] + \
        ceiling_section(bound.get("queueing_ceiling"))


def ceiling_section(ceiling: dict | None) -> list[str]:
    if ceiling is None:
        return []
    return [f"**Queueing ceiling: {100 * ceiling['utilization']:.1f}% of the bound.** A batch capped at "
            f"{ceiling['rows']} rows, admitting first come first served, on this step-time model, keeps the p99 TTFT "
            f"within {ceiling['ttft_limit_ms']:g} ms under Poisson arrivals up to that share of the bound "
            f"(median of seeded {ceiling['duration_s']:g} s runs): a burst that finds the batch full waits "
            f"(bench/queueing.py; a model of the engine, not a limit on every scheduler).", ""]


def loadgen_section(outcomes: list[Outcome]) -> list[str]:
    """Our figures next to LoadGen's own mlperf_log_summary.txt for runs driven by LoadGen."""
    lines = []
    for o in outcomes:
        lg = o.extra.get("loadgen")
        if not lg:
            continue
        ours = o.result.metrics.tokens_per_s if o.result.scenario == "Offline" else o.result.metrics.completed_tokens_per_s
        theirs = lg.get("tokens_per_s") or lg.get("completed_tokens_per_s")
        lines += [f"**LoadGen check ({o.result.scenario})**: LoadGen tokens/s {_fmt(theirs)}, ours {_fmt(ours)}; "
                  f"LoadGen result {lg.get('result', 'n/a')}, ours {o.verdict.label}. "
                  f"LoadGen summary: `{lg['summary_path']}`", ""]
    return lines


async def _offline_outcome(session: BenchSession, num_queries: int | None, driver: str, out_dir: str) -> Outcome:
    n = num_queries or len(session.samples)
    if driver == "loadgen":
        from tokenmill.bench.loadgen_driver import run_with_loadgen
        return await run_with_loadgen(session, "Offline", n, None, Path(out_dir) / "loadgen_offline")
    return await session.run(OfflineScenario(n, session.cfg.seed))


async def run_offline(cfg: BenchConfig, num_queries: int | None, driver: str, accuracy: bool, out_dir: str,
                      accuracy_targets: dict | None = None):
    async with BenchSession(cfg) as session:
        o = await _offline_outcome(session, num_queries, driver, out_dir)
        sections, summary = loadgen_section([o]), {"offline_tokens_per_s": o.result.metrics.tokens_per_s}
        if accuracy:
            from tokenmill.bench.accuracy import accuracy_section
            acc_lines, acc = accuracy_section(session.samples, o.result.records, cfg.dataset,
                                                accuracy_targets)
            sections += acc_lines
            summary["accuracy"] = acc
            o.extra["accuracy"] = acc
        return [o], sections, summary


async def run_server(cfg: BenchConfig, target_qps: float, max_query_count: int | None, driver: str,
                     with_offline: bool, out_dir: str):
    p = cfg.profile
    async with BenchSession(cfg) as session:
        outcomes = []
        offline = await _offline_outcome(session, None, driver, out_dir) if with_offline else None
        if offline:
            outcomes.append(offline)
        if driver == "loadgen":
            from tokenmill.bench.loadgen_driver import run_with_loadgen
            server = await run_with_loadgen(session, "Server", None, target_qps, Path(out_dir) / "loadgen_server")
        else:
            sc = ServerScenario(target_qps, p.min_duration_s, p.server_min_query_count, max_query_count, cfg.seed)
            server = await session.run(sc, label=f"Server @ {target_qps:g} QPS")
        outcomes.append(server)
        sections, ratio = ratio_section(server, offline)
        bound = step_time_bound(server, p.tpot_limit_ms, p.ttft_limit_ms)
        sections += bound_section(bound) + loadgen_section(outcomes)
        return outcomes, sections, {"server_offline_ratio": ratio, "step_time_bound": bound,
                                    "server_completed_tokens_per_s": server.result.metrics.completed_tokens_per_s}


def peak_table(rows: list[dict]) -> list[str]:
    lines = ["| # | phase | target QPS | queries | completed tok/s | p99 TTFT ms | p99 TPOT ms | failed | "
             "meets limits | full verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['phase']} | {r['target_qps']:.4g} | {r['num_queries']} | "
                     f"{_fmt(r['completed_tokens_per_s'])} | {_fmt(r['ttft_p99_ms'], 1)} | {_fmt(r['tpot_p99_ms'], 1)} "
                     f"| {r['failed']} | {_search_pass_cell(r)} | {r['verdict']} |")
    return lines + [""]


def _search_pass_cell(row: dict) -> str:
    if row["meets_limits"]:
        return "yes"
    misses = row.get("misses") or []
    return f"no ({'; '.join(misses)})" if misses else "no"


def peak_sections(result, out_dir: str, stem: str) -> list[str]:
    how = ("confirmed by a second run" if result.confirmed
           else "NOT confirmed: the best passing run; no room left to confirm it")
    if not result.confirmed and result.failed_confirmations:
        failed = ", ".join(f"{q:.4g}" for q in result.failed_confirmations)
        how = (f"NOT confirmed: the confirming run at {failed} QPS missed the limits and the run cap or time "
               "budget left no room to back off further; this is the best passing search run, an optimistic "
               "figure")
    head = (f"**Peak target QPS meeting the limits: {result.peak_qps:.4g}** ({how})"
            if result.peak_qps is not None else "**No target QPS met the limits** (lower the start QPS)")
    lines = ["## find-peak", "", head, "",
             "A run meets the limits for the search (like LoadGen's FindPeakPerformance) when its p99 TTFT and "
             "TPOT are within the limits, no request failed, and it reached its minimum duration and query count "
             "(a run cut short by the query cap is a fail: its burst never built the queue a full-length run "
             "would); early stopping is not tested. The full verdict of each run is in the last column.", ""]
    if result.stopped_by_max_runs:
        lines += ["The search stopped at its run cap or time budget before converging: the peak is a lower "
                  "bound (confirmed where a confirming run is listed).", ""]
    lines += peak_table(result.rows)
    if result.rows:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        png = plots.peak_search_plot(result.rows, Path(out_dir) / f"{stem}_search.png", "find-peak runs")
        lines += [f"![peak search]({png.name})", ""]
    return lines


async def run_find_peak(cfg: BenchConfig, search: PeakSearchConfig, out_dir: str, stem: str):
    async with BenchSession(cfg) as session:
        result = await find_peak(session, search)
    outcomes = [result.peak] if result.peak is not None else result.runs[-1:]
    bound = step_time_bound(result.peak, cfg.profile.tpot_limit_ms, cfg.profile.ttft_limit_ms)
    sections = peak_sections(result, out_dir, stem) + bound_section(bound)
    return outcomes, sections, peak_summary(result, bound)


def peak_summary(result, bound: dict | None) -> dict:
    """The JSON summary of a find-peak: peak_confirmed False means peak_qps is the best passing search run (no
    room left to confirm, or every confirmation missed: those QPS in failed_confirmations), an optimistic
    figure."""
    return {"peak_qps": result.peak_qps, "peak_confirmed": result.confirmed,
            "failed_confirmations": list(result.failed_confirmations),
            "stopped_by_max_runs": result.stopped_by_max_runs, "runs": result.rows, "step_time_bound": bound}


async def run_sweep_workflow(cfg: BenchConfig, levels: list[int], queries_per_level: int | None, out_dir: str,
                             stem: str):
    async with BenchSession(cfg) as session:
        outcomes, points, frontier = await run_sweep(session, levels, queries_per_level, cfg.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_sweep_csv(points, frontier, out / f"{stem}_pareto.csv")
    png = plots.pareto_plot(points, frontier, out / f"{stem}_pareto.png", "throughput vs interactivity")
    lines = ["## Concurrency sweep", "", "| concurrency | tokens/s | per-user tok/s | p50 TPOT ms | p99 TTFT ms | "
             "failed | Pareto |", "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['concurrency']} | {_fmt(p['tokens_per_s'])} | {_fmt(p['per_user_tokens_per_s'])} | "
                     f"{_fmt(p['tpot_p50_ms'], 1)} | {_fmt(p['ttft_p99_ms'], 1)} | {p['failed']} | "
                     f"{'yes' if p in frontier else ''} |")
    lines += ["", f"![Pareto frontier]({png.name})", "", f"CSV: `{csv_path.name}`", ""]
    return outcomes, lines, {"points": points, "frontier": frontier}
