"""Speculative decoding on the default model, speculation vs none in the same run (issue 17):

1. Batch-1 decode on summarization prompts: MLPerf's Llama 3.1 8B summarization prompt over the articles
   in benchmarks/data/public_domain_articles.jsonl, greedy, 128 output tokens (EOS ignored), one request
   at a time. Decode tok/s = (tokens - 1) / (last token time - first token time), the median over
   articles and --runs; the ratio to no speculation. Per proposer config (--configs), with its mean
   acceptance length.
2. Batch 64, Offline: 64 summarization requests (the articles repeated) at once, output tok/s of adaptive
   speculation vs none (the target: never a loss at high load), the median of --runs.
A config named with the suffix `+perop-verify` runs its verify steps on the per-op path, as before the native
decode program took them (platforms/cpu_decode.py: max_query_len 1), for a same-run comparison.
Every engine is built first and the runs interleave them (run 1 of each config, then run 2, ...), so a
drift of the machine's speed lands on every config alike.

    .venv/bin/python benchmarks/spec_decode.py [--runs 3] [--quantization int4] [--skip-offline]
        [--skip-batch1] [--mtp-head DIR]    # also the mtp configs, with a head from `tokenmill train-mtp --out DIR`
        [--kv-cache-dtype bfloat16]          # every engine's KV cache (default: float32)
        [--mtp-head DIR2 ...]                # several heads in one run: configs named e.g. mtp-k2-fixed@DIR2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

ARTICLES = os.path.join(os.path.dirname(__file__), "data", "public_domain_articles.jsonl")
CONFIGS = {
    "none": None,
    "ngram-k4-fixed": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "ngram-k4-adaptive": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram-k8-adaptive": {"method": "ngram", "num_speculative_tokens": 8},
    # self-speculation: the default model's first 20 of its 30 layers draft
    "self-20L-k3-fixed": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 20,
                          "adaptive": False},
    "self-20L-k3-adaptive": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 20},
}
MTP_CONFIGS = {   # the head's directory is added from --mtp-head; drafts among the head's default reduced
    # vocabulary (spec/draft_vocab.py), "fullvocab" among every token
    "mtp-k1-fixed": {"method": "mtp", "num_speculative_tokens": 1, "adaptive": False},
    "mtp-k2-fixed": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False},
    "mtp-k3-fixed": {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
    "mtp-k2-fixed-fullvocab": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False, "draft_vocab_size": 0},
    "mtp-k2-adaptive": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp-k3-adaptive": {"method": "mtp", "num_speculative_tokens": 3},
}


def prompts() -> list[str]:
    from tokenmill.bench.datasets import CNNDM_PROMPT
    with open(ARTICLES) as f:
        return [CNNDM_PROMPT.format(article=json.loads(line)["article"]) for line in f]


def batch1(llm, texts: list[str]) -> tuple[list[float], list[float]]:
    """One pass over the articles: decode tok/s per article, and mean acceptance lengths where drafted."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128, ignore_eos=True)
    rates, lengths = [], []
    for text in texts:
        out = llm.generate([text], params)[0].outputs[0]
        t = out.metrics.token_times
        rates.append((len(t) - 1) / (t[-1] - t[0]))
        if out.metrics.mean_acceptance_length is not None:
            lengths.append(out.metrics.mean_acceptance_length)
    return rates, lengths


def offline(llm, texts: list[str], n: int) -> float:
    """One Offline run of n requests at once: output tok/s."""
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128, ignore_eos=True)
    batch = [texts[i % len(texts)] for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quantization", default="int4", help="int4, int8, ... or fp32 (the float weights)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--offline-requests", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engines' KV cache: auto (float32), bfloat16 or fp8")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--mtp-head", action="append", default=[],
                    help="a `tokenmill train-mtp` directory: adds the mtp configs; given more than once, each head's "
                         "configs are named CONFIG@DIRNAME (heads compared in one run)")
    args = ap.parse_args()
    configs = dict(CONFIGS)
    for head in args.mtp_head:
        suffix = "" if len(args.mtp_head) == 1 else "@" + os.path.basename(os.path.normpath(head))
        configs.update({k + suffix: dict(v, model=head) for k, v in MTP_CONFIGS.items()})
    if args.mtp_head and args.configs == ",".join(CONFIGS):
        args.configs = ",".join(configs)
    unknown = [n for n in args.configs.split(",") if n.removesuffix("+perop-verify") not in configs]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; expected some of {', '.join(configs)}")
    from tokenmill import LLM
    quantization = None if args.quantization in ("fp32", "none") else args.quantization
    texts = prompts()
    print(f"default model, {args.quantization or 'fp32'}, KV cache {args.kv_cache_dtype}, {len(texts)} articles, "
          f"128 output tokens, medians of {args.runs}; {os.cpu_count()} cores")
    names = args.configs.split(",")
    engines = {}
    for name in names:              # every engine at once: the runs below interleave them (same drift)
        base_name = name.removesuffix("+perop-verify")
        engines[name] = LLM(quantization=quantization, speculative_config=configs[base_name],
                            enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30,
                            kv_cache_dtype=args.kv_cache_dtype)
        program = engines[name].engine.core.runner.fused_decode
        if name != base_name and program is not None:
            program.max_query_len = 1                                  # verify steps take the per-op path
        engines[name].generate(texts[:1], None)                        # warm-up
    rates = {name: [] for name in names}
    lengths = {name: [] for name in names}
    offline_rates = {name: [] for name in names}
    for run in range(args.runs):
        for name in names:
            if not args.skip_batch1:
                r, a = batch1(engines[name], texts)
                rates[name] += r
                lengths[name] += a
            if not args.skip_offline and "-fixed" not in name:
                offline_rates[name].append(offline(engines[name], texts, args.offline_requests))
                print(f"run {run + 1} {name}: offline x{args.offline_requests} {offline_rates[name][-1]:.1f} tok/s",
                      flush=True)
    results = {name: (statistics.median(rates[name]) if rates[name] else None,
                      statistics.mean(lengths[name]) if lengths[name] else None,
                      statistics.median(offline_rates[name]) if offline_rates[name] else None) for name in names}
    base = results.get("none")
    for name, (rate, length, off) in results.items():
        line = f"{name:24s}"
        if rate is not None:
            ratio = f" x{rate / base[0]:.2f}" if base and base[0] and name != "none" else ""
            acc = f", mean acceptance length {length:.2f}" if length else ""
            line += f" batch-1 decode {rate:7.1f} tok/s{ratio}{acc}"
        if off is not None:
            line += f"; offline x{args.offline_requests} {off:7.1f} tok/s" + \
                (f" x{off / base[2]:.3f}" if base and base[2] and name != "none" else "")
        print(line)


if __name__ == "__main__":
    main()
