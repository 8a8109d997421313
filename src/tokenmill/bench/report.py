"""Reports: a console summary in the spirit of LoadGen's mlperf_log_summary.txt, a results JSON, a
per-request JSONL per run, and a Markdown report with plots."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

from tokenmill.bench import plots
from tokenmill.bench.metrics import PERCENTILES
from tokenmill.bench.profiles import Profile
from tokenmill.bench.session import Outcome

RULE = "=" * 48
_PCTS = ["mean"] + [f"p{p * 100:g}" for p in PERCENTILES] + ["max"]


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _yes(flag: bool | None) -> str:
    return "n/a" if flag is None else ("Yes" if flag else "NO")


def _dist_line(name: str, dist: dict) -> str:
    if not dist or not dist.get("count"):
        return f"{name:<28}: not available"
    return f"{name:<28}: " + "  ".join(f"{k} {_fmt(dist.get(k), 1)}" for k in _PCTS)


def console_summary(o: Outcome, profile: Profile) -> str:
    r, m, v = o.result, o.result.metrics, o.verdict
    lines = [RULE, "tokenmill bench Results Summary", RULE,
             f"SUT name : {r.sut.get('name')} {r.sut.get('url') or ''}".rstrip(),
             f"Scenario : {r.scenario}" + (f"  (target QPS {r.target_qps:g})" if r.target_qps else "")
             + (f"  (concurrency {r.concurrency})" if r.concurrency else ""),
             f"Profile  : {profile.name} (p{profile.latency_percentile * 100:g} TTFT <= "
             f"{_fmt(profile.ttft_limit_ms, 0)} ms, TPOT <= {_fmt(profile.tpot_limit_ms, 0)} ms)"]
    if r.scenario == "Offline":
        lines += [f"Samples per second: {_fmt(m.request_throughput_rps)}", f"Tokens per second: {_fmt(m.tokens_per_s)}"]
    else:
        lines += [f"Completed samples per second    : {_fmt(m.completed_samples_per_s)}",
                  f"Completed tokens per second: {_fmt(m.completed_tokens_per_s)}"]
    lines += [f"Result is : {v.label}",
              f"  Performance constraints satisfied : {_yes(v.perf_constraints_met)}",
              f"  Min duration satisfied : {_yes(v.min_duration_met)}",
              f"  Min queries satisfied : {_yes(v.min_queries_met)}",
              f"  Early stopping satisfied: {_yes(v.early_stopping_met)}"]
    lines += (["Reasons:"] + [f" * {x}" for x in v.reasons]) if v.reasons else []
    lines += (["Notes:"] + [f" * {x}" for x in v.notes]) if v.notes else []
    lines += [e.message() for e in v.early_stopping]
    lines += ["", RULE, "Additional Stats", RULE,
              f"Requests issued / completed / failed: {m.num_issued} / {m.num_completed} / {m.num_failed}",
              f"Output tokens (from token ids): {m.total_output_tokens}   prompt tokens: {m.total_prompt_tokens}",
              f"Duration to last completion (s): {_fmt(m.duration_s)}",
              f"Request throughput (req/s): {_fmt(m.request_throughput_rps, 3)}   "
              f"goodput (req/s meeting both limits): {_fmt(m.goodput_rps, 3)}",
              f"Goodput tokens/s (requests meeting both limits): {_fmt(m.goodput_tokens_per_s)}   "
              f"SLO attainment: {_pct(m.slo_attainment)}",
              f"Per-user tokens/s (1000 / median TPOT ms): {_fmt(m.per_user_tokens_per_s)}",
              _dist_line("TTFT from scheduled (ms)", m.ttft_ms), _dist_line("TTFT from send (ms)", m.ttft_sent_ms),
              _dist_line("TPOT (ms)", m.tpot_ms), _dist_line("ITL token-level (ms)", m.itl_ms),
              _dist_line("Latency (ms)", m.latency_ms), _dist_line("Issue delay (ms)", m.issue_delay_ms)]
    if m.errors:
        lines += ["Errors:"] + [f" * {n}x {msg}" for msg, n in m.errors.items()]
    if o.efficiency is not None:
        lines += _efficiency_lines(o.efficiency)
    if o.extra.get("step_time_model"):
        lines += _step_model_lines(o.extra["step_time_model"])
    if o.extra.get("spec_decode"):
        lines += _spec_decode_lines(o.extra["spec_decode"])
    return "\n".join(lines)


def _spec_decode_lines(s: dict) -> list[str]:
    drafts = s["num_drafts"]
    per = ", ".join(f"{a / drafts:.0%}" for a in s["accepted_per_position"]) if drafts else "-"
    return [f"Speculative decoding (since the engine started): mean acceptance length "
            f"{_fmt(s['mean_acceptance_length'], 2)}, {s['num_accepted_tokens']}/{s['num_draft_tokens']} draft "
            f"tokens accepted over {drafts} drafts; acceptance by position: {per}"]


def _step_model_lines(s: dict) -> list[str]:
    return [f"Step-time model ({s.get('policy')} policy, prior: {s.get('source')}, {s.get('observations')} steps): "
            f"{_fmt(s.get('intercept_ms'), 2)} ms + {_fmt(s.get('per_decode_row_ms'), 3)} ms/decode row + "
            f"{_fmt(s.get('per_prefill_token_ms'), 3)} ms/prefill token + "
            f"{_fmt(s.get('per_1k_context_reads_ms'), 3)} ms/1k context reads + a step with prefill: "
            f"{_fmt(s.get('per_prefill_step_ms'), 2)} ms, {_fmt(s.get('per_mixed_step_ms'), 2)} ms more beside decode rows"
            + _decode_rows_text(s.get("decode_rows"))] + _decode_yield_lines(s.get("decode_yield"))


def _decode_yield_lines(y: dict | None) -> list[str]:
    if not y:
        return []
    return [f"Decode yield (speculation, recent steps): a decoding request computes {_fmt(y['new_tokens'], 2)} "
            f"new tokens a step and yields {_fmt(y['output_tokens'], 2)} output tokens (the SLO policy's "
            f"forecasts read both)"]


def _decode_rows_text(rows: dict | None) -> str:
    if not rows or rows.get("max_query_len", 1) <= 1:
        return ""
    return (f" (a request's up to {rows['max_query_len']} new tokens after its cached context, verify steps "
            f"included, are decode rows: the platform's fused decode program runs them)")


def _efficiency_lines(e) -> list[str]:
    return [f"Memory bandwidth (GB/s): {_fmt(e.bandwidth_gbs, 1)} [{e.bandwidth_source}]",
            f"Tokens/s per TB/s of bandwidth: {_fmt(e.tokens_per_s_per_tbs, 1)}",
            f"Decode roofline fraction: {_fmt(e.decode_roofline_fraction, 3)} "
            f"(bytes/step {_fmt(e.decode_bytes_per_step, 0)}, {e.decode_bytes_source})",
            f"Tokens per joule: {_fmt(e.tokens_per_joule, 3)} [{e.energy_source}]",
            f"USD per million tokens: {_fmt(e.usd_per_million_tokens, 4)}"
            + ("" if e.usd_per_hour is not None else " (pass --usd-per-hour)")]


def _jsonable(x):
    if is_dataclass(x):
        return asdict(x)
    return str(x)


def outcome_json(o: Outcome) -> dict:
    return {"label": o.label, "scenario": o.result.scenario, "target_qps": o.result.target_qps,
            "concurrency": o.result.concurrency, "wall_start_unix": o.result.wall_start_unix, "sut": o.result.sut,
            "metrics": o.result.metrics.to_json(), "verdict": o.verdict.to_json(),
            "efficiency": o.efficiency.to_json() if o.efficiency else None, **o.extra}


def write_requests_jsonl(o: Outcome, path: Path) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for rec in o.result.records:
            f.write(json.dumps(rec.to_json(include_chunks=False)) + "\n")
    return path


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()


def _md_run(o: Outcome, profile: Profile, out: Path, stem: str) -> list[str]:
    slug = _slug(o.label)
    lat = plots.latency_distributions(o.result.records, f"{o.label}: latency distributions",
                                      out / f"{stem}_{slug}_latency.png", profile.ttft_limit_ms, profile.tpot_limit_ms)
    tps = plots.throughput_over_time(o.result.records, f"{o.label}: output tokens/s over time",
                                     out / f"{stem}_{slug}_tokens_per_s.png")
    jsonl = write_requests_jsonl(o, out / f"{stem}_{slug}_requests.jsonl")
    return [f"## {o.label}: **{o.verdict.label}**", "", "```", console_summary(o, profile), "```", "",
            f"![latency]({lat.name})", "", f"![tokens/s]({tps.name})", "", f"Per-request records: `{jsonl.name}`", ""]


def write_report(out_dir: str | Path, stem: str, title: str, profile: Profile, outcomes: list[Outcome],
                 config: dict, sections: list[str] | None = None, summary: dict | None = None) -> dict[str, Path]:
    """Write <stem>.json, <stem>.md, per-run JSONL and PNGs under out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = [f"# {title}", "", f"Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.", ""]
    if not profile.submission_length:
        shortfalls = dict.fromkeys(profile.length_shortfalls("Server") + profile.length_shortfalls("Offline"))
        md += [f"> **Not of submission length:** {'; '.join(shortfalls)}. These are development figures.", ""]
    md += sections or []
    md += ["| run | verdict | tokens/s | goodput tokens/s | SLO attainment | p99 TTFT ms | p99 TPOT ms | failed |",
           "|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        m = o.result.metrics
        tps = m.tokens_per_s if o.result.scenario == "Offline" else m.completed_tokens_per_s
        md.append(f"| {o.label} | {o.verdict.label} | {_fmt(tps)} | {_fmt(m.goodput_tokens_per_s)} | "
                  f"{_pct(m.slo_attainment)} | {_fmt(m.ttft_ms.get('p99'), 1)} | "
                  f"{_fmt(m.tpot_ms.get('p99'), 1)} | {m.num_failed} |")
    md.append("")
    for o in outcomes:
        md += _md_run(o, profile, out, stem)
    md += ["## Configuration", "", "```json", json.dumps(config, indent=2, default=_jsonable), "```", ""]
    payload = {"title": title, "profile": asdict(profile), "config": config, "summary": summary or {},
               "runs": [outcome_json(o) for o in outcomes]}
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(payload, indent=2, default=_jsonable), encoding="utf-8")
    md_path = out / f"{stem}.md"
    md_path.write_text("\n".join(md), encoding="utf-8")
    return {"json": json_path, "markdown": md_path}
