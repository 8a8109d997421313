"""One MoE layer's step at batch 64 on this CPU, tokenmill's SparseMoeBlock against transformers' in the
same run (issue 18): Qwen3-MoE-shaped, 64 experts of hidden 1024 x intermediate 512 (400 MB of float32
expert weights: weight-bound), top-8 routing, so every expert is hit at batch 64.

Rows: transformers' Qwen3MoeSparseMoeBlock with its eager experts (the per-expert loop) and with its
default experts implementation; tokenmill's block with float32, int8 and int4 experts (the same
weights). Per row: the median ms per step over --runs timed steps (after warm-up), tokens/s, the ratio to
transformers eager, the bytes of expert weights the step reads, and how many times each expert's
weights were read per step (grouped_linears: counted by hooks; the native kernel passes over each
expert's weights once by construction, csrc/moe_kernels.cpp).

    .venv/bin/python benchmarks/moe_step.py [--runs 20] [--batch 64] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 1024, 512, 64, 8


def hf_block(implementation: str):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, norm_topk_prob=True,
                                      experts_implementation=implementation)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.03)
    return block


def ours_from(hf, quantization: str | None, kernel: str):
    from tokenmill.config import MoEConfig
    from tokenmill.layers.moe import SparseMoeBlock
    from tokenmill.layers.quantize import quantize_model
    block = SparseMoeBlock(HIDDEN, MoEConfig(EXPERTS, TOP_K, INTERMEDIATE, (0,), renormalize=True), torch.float32)
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        for e, expert in enumerate(block.experts.local_experts()):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])       # [2I, H]: gate | up
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])             # [H, I]
    quantize_model(block, quantization)
    if kernel != "grouped_linears":
        block.experts.set_kernel(kernel)
    return block.eval()


def expert_reads(block, x) -> float:
    """Calls of expert forwards per distinct expert hit in one step (1.0: each expert read once)."""
    calls = []
    hooks = [e.register_forward_hook(lambda m, i, o: calls.append(m)) for e in block.experts.local_experts()]
    block(x)
    for h in hooks:
        h.remove()
    return len(calls) / len({id(m) for m in calls})


@torch.inference_mode()
def time_steps(fn, x, runs: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def expert_bytes(block) -> int:
    """Bytes of expert weights the step reads: the Linears' own, or the stacked copies a kernel made."""
    return sum(t.numel() * t.element_size() for t in list(block.experts.parameters()) + list(block.experts.buffers())
               if t.dim() >= 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.batch, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.5
    hf_eager = hf_block("eager")
    with torch.inference_mode():
        want = hf_eager(x.unsqueeze(0))[0]
    rows = [("transformers eager", lambda v: hf_eager(v.unsqueeze(0)), 4 * 3 * EXPERTS * HIDDEN * INTERMEDIATE, None)]
    hf_default = hf_block(None)
    rows.append((f"transformers default ({hf_default.experts.config._experts_implementation or 'auto'})",
                 lambda v: hf_default(v.unsqueeze(0)), rows[0][2], None))
    from tokenmill.platforms.cpu import CPUPlatform
    platform = CPUPlatform(torch.device("cpu"))
    for q in (None, "int8", "int4"):
        for kernel in ("grouped_linears", "native"):
            probe = ours_from(hf_eager, q, "grouped_linears")
            chosen = platform.moe_kernel(probe.experts) if kernel == "native" else kernel
            if kernel == "native" and chosen == "grouped_linears":
                continue                               # no native kernel for this format here
            block = probe if chosen == "grouped_linears" else ours_from(hf_eager, q, chosen)
            with torch.inference_mode():
                err = ((block(x) - want).norm() / want.norm()).item()
                reads = expert_reads(block, x) if chosen == "grouped_linears" else 1.0
            rows.append((f"tokenmill {q or 'float32'} {chosen} (rel. err {err:.1e}, reads/expert {reads:.0f})",
                         block, expert_bytes(block), err))
    print(f"MoE layer, batch {args.batch}, {EXPERTS} experts {HIDDEN}x{INTERMEDIATE}, top-{TOP_K}, "
          f"{args.threads} threads, median of {args.runs}")
    base = None
    for name, fn, nbytes, _ in rows:
        s = time_steps(fn, x, args.runs)
        base = base or s
        print(f"{name:60s} {s * 1e3:8.2f} ms  {args.batch / s:8.0f} tok/s  x{base / s:5.2f}  "
              f"{nbytes / 2**20:6.0f} MiB experts, {nbytes / s / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
