"""gpt-oss's attention (a sink logit per head, sliding windows) on this CPU: the CPU backend's native kernels
against the torch ops of layers/attention/sinks.py (the reference backend's forward_with_sinks), same
inputs, same run; each call also writes the step's new keys and values into the cache.

gpt-oss-20b's attention shapes: 64 query heads, 8 kv heads, head dim 64; its sliding layers read the last
128 positions, its full layers everything. Cases: decode steps (one new token per request) at batch 1 and
64 over a context of --context tokens, and one prefill chunk of --prefill tokens starting at 0, each with
the window (128) and without it (full). Caches are random float32 in blocks of 16 slots, scattered. Per
row: the median ms over --runs calls after 3 warm-up calls, for the torch path and the native kernels, and their
ratio. Both give the same values (tests/layers/test_sink_attention.py); this is speed only.

    .venv/bin/python benchmarks/sink_attention.py [--runs 10] [--context 2048] [--prefill 512] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from moe_step import time_steps  # noqa: E402  (benchmarks/, the script's own directory)

HEADS, KV_HEADS, HEAD_DIM, WINDOW, BLOCK = 64, 8, 64, 128, 16


def metadata(context_lens: list[int], query_lens: list[int], seed: int = 0):
    """AttentionMetadata for requests whose last query_lens[i] of context_lens[i] positions are new, over
    shuffled blocks; decodes (query length 1) get the padded decode tables, chunks the prefill tables."""
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in context_lens]
    perm = torch.randperm(sum(blocks), generator=g)
    seqs, used, start = [], 0, 0
    for n, q, b in zip(context_lens, query_lens, blocks):
        pos = torch.arange(n)
        mine = perm[used:used + b]
        seqs.append(SeqSpan(start, q, n, mine[pos // BLOCK] * BLOCK + pos % BLOCK))
        used, start = used + b, start + q
    slot_mapping = torch.cat([s.context_slots[s.context_len - s.query_len:] for s in seqs])
    slots = torch.zeros(len(seqs), max(context_lens), dtype=torch.long)         # padded with slot 0
    for i, s in enumerate(seqs):
        slots[i, :s.context_len] = s.context_slots
    if all(q == 1 for q in query_lens):
        meta = AttentionMetadata(slot_mapping, seqs, decode_rows=torch.arange(len(seqs)), decode_slots=slots,
                                 decode_lens=torch.tensor(context_lens))
    else:
        spans = torch.tensor([[s.query_start, s.query_len, s.context_len] for s in seqs])
        meta = AttentionMetadata(slot_mapping, seqs, prefill_spans=spans, prefill_slots=slots)
    return meta, sum(blocks) * BLOCK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill.layers.attention import get_backend
    cpu, reference = get_backend("cpu"), get_backend("reference")
    if cpu.native is None or not cpu.native.prefill_attention_supports(HEAD_DIM):
        raise SystemExit("the native kernels are not built here (AVX-512 and a compiler): nothing to compare")
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(HEADS, generator=g)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; gpt-oss-20b attention shapes ({HEADS} heads, {KV_HEADS} kv heads, head dim "
          f"{HEAD_DIM}), float32; median of {args.runs}")
    print(f"{'case':42s} {'torch ms':>9s} {'native ms':>9s} {'speed-up':>8s}")
    cases = [(f"decode batch {b}, context {args.context}", [args.context] * b, [1] * b) for b in (1, 64)]
    cases.append((f"prefill {args.prefill} tokens", [args.prefill], [args.prefill]))
    for name, contexts, queries in cases:
        meta, slots = metadata(contexts, queries)
        k_cache, v_cache = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=g), torch.randn(KV_HEADS, slots, HEAD_DIM, generator=g)
        q = torch.randn(sum(queries), HEADS, HEAD_DIM, generator=g)
        k, v = torch.randn(sum(queries), KV_HEADS, HEAD_DIM, generator=g), torch.randn(sum(queries), KV_HEADS, HEAD_DIM, generator=g)
        for window in (WINDOW, None):
            def timed(backend) -> float:
                """Median ms per call (moe_step.time_steps: 3 warm-up calls, then --runs timed)."""
                return 1e3 * time_steps(lambda _: backend.forward_with_sinks(q, k, v, k_cache, v_cache, meta, 0.125,
                                                                             sinks, window), None, args.runs)
            native, torch_ms = timed(cpu), timed(reference)
            label = f"{name}, {'window ' + str(WINDOW) if window else 'full'}"
            print(f"{label:42s} {torch_ms:9.2f} {native:9.2f} {torch_ms / native:7.1f}x", flush=True)


if __name__ == "__main__":
    main()
