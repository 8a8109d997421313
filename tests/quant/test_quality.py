"""Each quantized mode on the default model, through both kernel paths (one-pass prefill, and chunks of
up to 16 tokens as decode steps run): perplexity (of the text's first 256 tokens) within 3% of fp32 and teacher-forced greedy agreement
>= 90% (definitions in benchmarks/quant_quality.py, which prints the same figures)."""
from __future__ import annotations

import importlib.util
import os

import pytest

MAX_PPL_RISE = 0.03
MIN_AGREEMENT = 0.90


def load_quality_module():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "quant_quality.py")
    spec = importlib.util.spec_from_file_location("quant_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quantized_modes_keep_quality():
    # perplexity over the text's first 256 tokens (the benchmark reads all ~700): w8a8's AVX2 kernels are slow
    # fp8: its fast mode (bfloat16 activations, float32 sums) on the prefill and decode paths
    modes = ["int8", "int4", "w8a8", "fp8"]
    results = load_quality_module().evaluate(modes, full=False, text_tokens=256)
    for mode in modes:
        for path in ("prefill", "decode"):
            r, name = results[mode][path], f"{mode} ({path} path)"
            assert r["ppl_rise"] <= MAX_PPL_RISE, f"{name}: perplexity {r['ppl']:.3f} is {r['ppl_rise']:+.2%} vs fp32"
            assert r["teacher_forced"] >= MIN_AGREEMENT, f"{name}: greedy agreement {r['teacher_forced']:.1%}"
