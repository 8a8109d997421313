"""`tokenmill bench offline | server | find-peak | sweep`: argument parsing and the four handlers.

Each handler takes the argparse Namespace and returns an exit code: 0 when the benchmark ran (its
verdict, VALID or INVALID, is in the report; with --strict an INVALID run returns 1), 2 for a user
error (bad option, missing file, unreachable server), with a one-line message and no traceback.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from tokenmill.bench.profiles import DEFAULT_PROFILE, PROFILES, Profile, apply_conf, get_profile
from tokenmill.bench.session import BenchConfig

SCENARIO_OF = {"offline": "Offline", "server": "Server", "find-peak": "Server", "sweep": "Server"}


def _add_common(p: argparse.ArgumentParser, report: bool = True) -> None:
    """The options every bench command takes; report=False (tune): without those of the report it writes."""
    from tokenmill.config import EngineArgs
    t = p.add_argument_group("target (in-process engine unless --url)")
    t.add_argument("--url", default=None, help="OpenAI-compatible server base URL (e.g. http://127.0.0.1:8000)")
    t.add_argument("--served-model-name", default=None, help="model field sent to --url (default: first of /v1/models)")
    t.add_argument("--api-key", default=None)
    EngineArgs.add_cli_args(p)     # --model, --tokenizer, --seed, engine sizing
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="synthetic", choices=["synthetic", "jsonl", "cnndm"])
    d.add_argument("--dataset-path", default=None, help="JSONL/JSON file for --dataset jsonl or cnndm")
    d.add_argument("--num-samples", type=int, default=64, help="samples in the dataset (synthetic) or read (files)")
    d.add_argument("--prompt-len", default="128", help="synthetic prompt tokens: N, LOW-HIGH or normal:MEAN,STD")
    d.add_argument("--output-len", default="128", help="output tokens: N, LOW-HIGH or normal:MEAN,STD")
    d.add_argument("--no-exact-output", dest="exact_output", action="store_false",
                   help="synthetic: let EOS end outputs (default: ignore_eos and min_tokens = max_tokens)")
    d.add_argument("--vocab-size", type=int, default=None, help="synthetic prompts over --url without --tokenizer")
    r = p.add_argument_group("rules")
    r.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES) + ["custom"])
    r.add_argument("--ttft-ms", type=float, default=None, help="p99 TTFT limit, ms (overrides the profile)")
    r.add_argument("--tpot-ms", type=float, default=None, help="p99 TPOT limit, ms (overrides the profile)")
    r.add_argument("--mlperf-conf", default=None, help="LoadGen-style user.conf (model.scenario.key = value)")
    r.add_argument("--min-duration-s", type=float, default=None,
                   help="minimum run duration, s (default: the profile's, MLPerf's 600 s); shorter marks the run "
                        "as a development run, not of submission length")
    r.add_argument("--min-query-count", type=int, default=None,
                   help="minimum queries of the command's own runs (offline: Offline's, MLPerf 13,368; otherwise "
                        "Server's, 100); fewer marks them as development runs")
    r.add_argument("--temperature", type=float, default=None, help="default: greedy (MLPerf)")
    r.add_argument("--request-timeout-s", type=float, default=None)
    o = p.add_argument_group("output and efficiency" if report else "output")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    if not report:
        return
    o.add_argument("--out-dir", default="results/bench")
    o.add_argument("--name", default=None, help="file stem of the report (default: the subcommand)")
    o.add_argument("--strict", action="store_true", help="exit 1 when a run is INVALID")
    o.add_argument("--mem-bandwidth-gbs", type=float, default=None, help="memory bandwidth, GB/s")
    o.add_argument("--usd-per-hour", type=float, default=None, help="system price for cost per million tokens")
    o.add_argument("--weights-bytes", type=int, default=None, help="model weight bytes (decode roofline)")
    o.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV cache bytes per token (decode roofline)")


def add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="MLPerf-style benchmarks (Offline, Server, peak search, sweep)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser("offline", help="all samples issued at t = 0; tokens/s")
    _add_common(p)
    p.add_argument("--num-queries", type=int, default=None, help="samples in the query (default: the dataset)")
    p.add_argument("--driver", default="native", choices=["native", "loadgen"],
                   help="loadgen: drive the run with the official MLPerf LoadGen (mlcommons-loadgen)")
    p.add_argument("--accuracy", action="store_true", help="score outputs against references with ROUGE")
    p.add_argument("--accuracy-targets", default=None,
                   help="rouge1=..,rouge2=..,rougeL=..,rougeLsum=..,gen_len=.. each checked at 99%% "
                        "(default for --dataset cnndm: MLPerf Llama 3.1 8B)")
    p.set_defaults(func=cmd_offline)
    p = sub.add_parser("server", help="Poisson arrivals at --target-qps; completed tokens/s under latency limits")
    _add_common(p)
    p.add_argument("--target-qps", type=float, required=True)
    p.add_argument("--max-query-count", type=int, default=None)
    p.add_argument("--driver", default="native", choices=["native", "loadgen"])
    p.add_argument("--with-offline", action="store_true", help="also run Offline and report Server/Offline")
    p.add_argument("--offline-min-query-count", type=int, default=None,
                   help="with --with-offline: Offline's minimum queries (default: the profile's, MLPerf's 13,368; "
                        "--min-query-count sets Server's only)")
    p.set_defaults(func=cmd_server)
    p = sub.add_parser("find-peak", help="highest target QPS meeting the limits (binary search + confirmation)")
    _add_common(p)
    p.add_argument("--start-qps", type=float, default=0.25, help="lower bound checked first")
    p.add_argument("--precision", type=float, default=0.05, help="relative QPS precision of the search")
    p.add_argument("--max-runs", type=int, default=12)
    p.add_argument("--max-query-count", type=int, default=None)
    p.set_defaults(func=cmd_find_peak)
    p = sub.add_parser("sweep", help="closed-loop concurrency sweep; Pareto frontier of tokens/s vs per-user tokens/s")
    _add_common(p)
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrency levels")
    p.add_argument("--queries-per-level", type=int, default=None, help="default: 4 x concurrency, at least 8")
    p.set_defaults(func=cmd_sweep)


# BenchConfig fields of the report's efficiency section only (tune takes none of them)
REPORT_ONLY = ("mem_bandwidth_gbs", "usd_per_hour", "weights_bytes", "kv_bytes_per_token")


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    profile = get_profile(ns.profile, ns.ttft_ms, ns.tpot_ms)
    if ns.mlperf_conf:
        profile = apply_conf(profile, ns.mlperf_conf, SCENARIO_OF.get(getattr(ns, "bench_command", None), "Server"))
    profile = _with_length_options(profile, ns)
    engine_args = None
    if not ns.url:
        from tokenmill.config import EngineArgs
        engine_args = EngineArgs.from_cli_args(ns)
    return BenchConfig(profile=profile, url=ns.url, engine_args=engine_args, served_model_name=ns.served_model_name,
                       api_key=ns.api_key, tokenizer=ns.tokenizer, dataset=ns.dataset, dataset_path=ns.dataset_path,
                       num_samples=ns.num_samples, prompt_len=ns.prompt_len, output_len=ns.output_len,
                       exact_output=ns.exact_output, vocab_size=ns.vocab_size, temperature=ns.temperature,
                       seed=ns.seed, request_timeout_s=ns.request_timeout_s, progress=ns.progress,
                       **{k: getattr(ns, k, None) for k in REPORT_ONLY})


def _with_length_options(profile: Profile, ns: argparse.Namespace) -> Profile:
    """--min-duration-s for every run; --min-query-count for the command's own scenario only (Offline's for
    `offline`, else Server's); Offline's under `server --with-offline` only from --offline-min-query-count.
    A minimum not given stays the profile's (MLPerf's unless --mlperf-conf changed it)."""
    duration = profile.min_duration_s if ns.min_duration_s is None else ns.min_duration_s
    server, offline = profile.server_min_query_count, profile.offline_min_query_count
    if SCENARIO_OF.get(getattr(ns, "bench_command", None)) == "Offline":
        offline = offline if ns.min_query_count is None else ns.min_query_count
    else:
        server = server if ns.min_query_count is None else ns.min_query_count
        offline_given = getattr(ns, "offline_min_query_count", None)
        offline = offline if offline_given is None else offline_given
    return profile.with_dev_length(duration, server, offline)


def _guard(body):
    """Run a handler body; user errors become a one-line message and exit code 2."""
    try:
        return body()
    except (ValueError, FileNotFoundError, ConnectionError, ImportError) as e:
        print(f"tokenmill bench: error: {e}", file=sys.stderr)
        return 2


def _finish(ns, cfg: BenchConfig, title: str, outcomes, sections=None, summary=None) -> int:
    from tokenmill.bench.report import console_summary, write_report
    for o in outcomes:
        print(console_summary(o, cfg.profile))
    paths = write_report(ns.out_dir, ns.name or ns.bench_command.replace("-", "_"), title, cfg.profile, outcomes,
                         config_json(ns), sections, summary)
    for line in sections or []:
        if line.startswith("**"):       # headline lines: peak QPS, Server/Offline ratio, LoadGen check
            print(line.replace("**", ""))
    print(f"report: {paths['markdown']}  results: {paths['json']}")
    return 1 if ns.strict and not all(o.verdict.valid for o in outcomes) else 0


def config_json(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if k != "func" and not callable(v)}


def cmd_offline(ns: argparse.Namespace) -> int:
    def body():
        from tokenmill.bench.accuracy import parse_targets
        from tokenmill.bench.workflows import run_offline
        cfg = config_from_args(ns)
        targets = parse_targets(ns.accuracy_targets)
        outcomes, sections, summary = asyncio.run(run_offline(cfg, ns.num_queries, ns.driver, ns.accuracy,
                                                              ns.out_dir, targets))
        return _finish(ns, cfg, "tokenmill bench: Offline", outcomes, sections, summary)
    return _guard(body)


def cmd_server(ns: argparse.Namespace) -> int:
    def body():
        from tokenmill.bench.workflows import run_server
        cfg = config_from_args(ns)
        outcomes, sections, summary = asyncio.run(run_server(cfg, ns.target_qps, ns.max_query_count, ns.driver,
                                                             ns.with_offline, ns.out_dir))
        return _finish(ns, cfg, "tokenmill bench: Server", outcomes, sections, summary)
    return _guard(body)


def cmd_find_peak(ns: argparse.Namespace) -> int:
    def body():
        from tokenmill.bench.find_peak import PeakSearchConfig
        from tokenmill.bench.workflows import run_find_peak
        cfg = config_from_args(ns)
        search = PeakSearchConfig(ns.start_qps, ns.precision, ns.max_runs, min_duration_s=cfg.profile.min_duration_s,
                                  min_query_count=cfg.profile.server_min_query_count,
                                  max_query_count=ns.max_query_count, seed=cfg.seed)
        outcomes, sections, summary = asyncio.run(run_find_peak(cfg, search, ns.out_dir, ns.name or "find_peak"))
        return _finish(ns, cfg, "tokenmill bench: find-peak (Server)", outcomes, sections, summary)
    return _guard(body)


def cmd_sweep(ns: argparse.Namespace) -> int:
    def body():
        from tokenmill.bench.workflows import run_sweep_workflow
        cfg = config_from_args(ns)
        try:
            levels = [int(x) for x in ns.concurrency.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--concurrency must be comma-separated integers, got {ns.concurrency!r}") from None
        outcomes, sections, summary = asyncio.run(run_sweep_workflow(cfg, levels, ns.queries_per_level, ns.out_dir,
                                                                     ns.name or "sweep"))
        return _finish(ns, cfg, "tokenmill bench: concurrency sweep", outcomes, sections, summary)
    return _guard(body)


def run_main_job(out_dir: str = "results") -> int:
    """`make run`: Offline, then find-peak for Server, then the summary and Markdown report (dev length)."""
    from tokenmill.bench.main_job import main_job
    t0 = time.perf_counter()
    code = main_job(out_dir)
    print(f"main job finished in {time.perf_counter() - t0:.0f} s")
    return code


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (`python -m tokenmill.bench.cli bench ...`) until the top-level CLI wires it."""
    parser = argparse.ArgumentParser(prog="tokenmill")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
