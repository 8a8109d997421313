"""PNG plots for reports (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenmill.bench.metrics import tokens_over_time  # noqa: E402


def latency_distributions(records, title: str, path: Path, ttft_limit_ms: float | None = None,
                          tpot_limit_ms: float | None = None) -> Path:
    """Histograms of TTFT (from scheduled and from send), TPOT and end-to-end latency, in ms."""
    done = [r for r in records if r.ok]
    panels = [("TTFT from scheduled time (ms)", [r.ttft_s * 1e3 for r in done], ttft_limit_ms),
              ("TTFT from send time (ms)", [r.ttft_sent_s * 1e3 for r in done if r.ttft_sent_s is not None], None),
              ("TPOT (ms)", [r.tpot_s * 1e3 for r in done if r.tpot_s is not None], tpot_limit_ms),
              ("latency (ms)", [r.latency_s * 1e3 for r in done], None)]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values, limit) in zip(axes.flat, panels):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 3)), color="#4c72b0")
        if limit is not None:
            ax.axvline(limit, color="red", linestyle="--", label=f"limit {limit:g} ms")
            ax.legend()
        ax.set_title(name)
        ax.set_ylabel("requests")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def throughput_over_time(records, title: str, path: Path, bucket_s: float = 1.0) -> Path:
    series = tokens_over_time(records, bucket_s)
    fig, ax = plt.subplots(figsize=(9, 4))
    if series:
        ax.plot([t for t, _ in series], [v for _, v in series], drawstyle="steps-post")
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel(f"output tokens/s ({bucket_s:g} s buckets)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def pareto_plot(points: list[dict], frontier: list[dict], path: Path, title: str) -> Path:
    """points/frontier: dicts with per_user_tokens_per_s, tokens_per_s and concurrency."""
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([p["per_user_tokens_per_s"] for p in points], [p["tokens_per_s"] for p in points],
               color="#999999", label="runs")
    for p in points:
        ax.annotate(f"c={p['concurrency']}", (p["per_user_tokens_per_s"], p["tokens_per_s"]), fontsize=8,
                    textcoords="offset points", xytext=(4, 4))
    ax.plot([p["per_user_tokens_per_s"] for p in frontier], [p["tokens_per_s"] for p in frontier],
            color="#c44e52", marker="o", label="Pareto frontier")
    ax.set_xlabel("per-user tokens/s (1000 / median TPOT ms)")
    ax.set_ylabel("total output tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def peak_search_plot(rows: list[dict], path: Path, title: str) -> Path:
    """p99 TTFT and TPOT against target QPS for every run a peak search tried."""
    rows = sorted(rows, key=lambda r: r["target_qps"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["target_qps"] for r in rows], [r["ttft_p99_ms"] or 0 for r in rows], marker="o", label="p99 TTFT")
    ax2 = ax.twinx()
    ax2.plot([r["target_qps"] for r in rows], [r["tpot_p99_ms"] or 0 for r in rows], marker="s", color="#c44e52",
             label="p99 TPOT")
    ax.set_xlabel("target QPS")
    ax.set_ylabel("p99 TTFT (ms)")
    ax2.set_ylabel("p99 TPOT (ms)")
    ax.set_title(title)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
