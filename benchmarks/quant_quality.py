"""Quality of each quantized mode against fp32 on the default model: perplexity and greedy agreement.

Perplexity: of tests/quant/data/ppl_text.txt (about 700 tokens), exp(mean next-token NLL), through the
engine's model (`llm.engine.core.runner.model` on hand-built metadata: one sequence, cache slots 0..T-1,
so the LLMs here run with prefix caching off) in two ways, as steps of many rows and of few rows run them
(different attention code, and for fp32 different GEMMs; int8/int4 run the tile kernels on both):
  prefill: one forward pass of the whole text;
  decode:  the text in chunks of DECODE_CHUNK tokens over the KV cache, as decode at batch 16 runs.
Greedy agreement, for 8 fixed prompts x 32 greedy tokens (ignore EOS), fp32's continuations as reference:
  teacher-forced: the quantized model reads prompt + fp32's continuation; the fraction of the 256
      positions where its argmax equals fp32's token (every position judged in the same context), by
      both paths as above.
  prefix: the quantized model generates freely; tokens equal to fp32's up to the first divergence,
      over all 256 (strict: one early flip discounts the rest of that prompt).

    .venv/bin/python benchmarks/quant_quality.py [--modes int8,int4,w8a8,fp8,nvfp4,nvfp4-exact,mxfp4,mxfp4-exact]

tests/quant/test_quality.py checks, for both paths: perplexity at most 3% above fp32, teacher-forced
agreement >= 90%.
"""
from __future__ import annotations

import argparse
import math
import os

import torch

TEXT_PATH = os.path.join(os.path.dirname(__file__), "..", "tests", "quant", "data", "ppl_text.txt")
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "def fibonacci(n):",
    "The most important invention of the nineteenth century was",
    "Photosynthesis is the process by which",
]
NUM_TOKENS = 32


def make_llm(mode: str | None):
    """mode: a weight quantization method, or "fp8-kv" (float32 weights, FP8 KV cache; the one-pass
    prefill path attends to fresh keys, so only the chunked decode path reads the FP8 cache), or
    "nvfp4-exact" / "mxfp4-exact" (the FP4 formats' float32-activation reference modes; without the suffix
    they run their int8-activation fast mode where the tile kernels exist)."""
    from tokenmill import LLM
    from tokenmill.quant import fp4
    if mode == "fp8-kv":
        return LLM(kv_cache_dtype="fp8", enable_prefix_caching=False, kv_cache_memory_bytes=1 << 27)
    methods = {"nvfp4": fp4.NVFP4Method, "mxfp4": fp4.MXFP4Method}
    base = mode.removesuffix("-exact") if mode else mode
    exact = base in methods and mode.endswith("-exact")
    saved = methods[base].int8_activations if base in methods else None
    if exact:
        methods[base].int8_activations = False
    try:
        return LLM(quantization=base, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 27)
    finally:
        if exact:
            methods[base].int8_activations = saved


@torch.inference_mode()
def forward_logits(llm, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """token_ids [T] -> next-token logits [T, vocab] float32 of one sequence: one prefill, or chunks of
    `chunk` tokens each attending to the cache the earlier chunks wrote."""
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model = llm.engine.core.runner.model
    n = len(token_ids)
    chunk = chunk or n
    slots, ids, out = torch.arange(n), torch.tensor(token_ids), []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = AttentionMetadata(slot_mapping=slots[start:end], seqs=[SeqSpan(0, end - start, end, slots[:end])])
        out.append(model.compute_logits(model(ids[start:end], torch.arange(start, end), meta)))
    return torch.cat(out)


def perplexity(llm, token_ids: list[int], chunk: int | None = None) -> float:
    logits = forward_logits(llm, token_ids, chunk)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(token_ids[1:]))
    return math.exp(nll.item())


def greedy(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    from tokenmill import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]


def teacher_forced_agreement(llm, prompt_ids, ref_outputs, chunk: int | None = None) -> float:
    hits = total = 0
    for p, ref in zip(prompt_ids, ref_outputs):
        pred = forward_logits(llm, p + ref, chunk)[len(p) - 1: len(p) - 1 + len(ref)].argmax(-1).tolist()
        hits += sum(a == b for a, b in zip(pred, ref))
        total += len(ref)
    return hits / total


def prefix_agreement(outputs, ref_outputs) -> float:
    same = 0
    for out, ref in zip(outputs, ref_outputs):
        for a, b in zip(out, ref):
            if a != b:
                break
            same += 1
    return same / sum(len(r) for r in ref_outputs)


DECODE_CHUNK = 16
PATHS = {"prefill": None, "decode": DECODE_CHUNK}       # path name -> chunk size (None: one pass)


def chunk_of(path: str) -> int | None:
    return PATHS[path]


def evaluate(modes: list[str], full: bool = True,
             text_tokens: int | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {path: {ppl, ppl_rise, teacher_forced}}, plus "prefix"} with "fp32" as the reference: its
    one-pass perplexity and greedy tokens (its chunked pass, shown too, differs only by float rounding).
    full=False leaves out what only the printed table shows (fp32's own paths, each mode's free-running
    prefix agreement): tests/quant/test_quality.py's checks. text_tokens: perplexity over the text's first
    that many tokens (None: all)."""
    with open(TEXT_PATH, encoding="utf-8") as f:
        text = f.read()
    llm = make_llm(None)
    text_ids = llm.tokenizer.encode(text)[:text_tokens]
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ref_ppl, ref_out = perplexity(llm, text_ids), greedy(llm, prompt_ids)
    results = {"fp32": {}}
    for path in (PATHS if full else ()):
        ppl = perplexity(llm, text_ids, chunk_of(path))
        results["fp32"][path] = dict(ppl=ppl, ppl_rise=ppl / ref_ppl - 1,
                                     teacher_forced=teacher_forced_agreement(llm, prompt_ids, ref_out, chunk_of(path)))
    results["fp32"].update(prefix=1.0, num_text_tokens=len(text_ids))
    del llm
    for mode in modes:
        llm = make_llm(mode)
        results[mode] = {}
        for path in PATHS:
            ppl = perplexity(llm, text_ids, chunk_of(path))
            results[mode][path] = dict(ppl=ppl, ppl_rise=ppl / ref_ppl - 1,
                                       teacher_forced=teacher_forced_agreement(llm, prompt_ids, ref_out,
                                                                               chunk_of(path)))
        if full:
            results[mode]["prefix"] = prefix_agreement(greedy(llm, prompt_ids), ref_out)
        del llm
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="int8,int4,w8a8")
    args = ap.parse_args()
    results = evaluate(args.modes.split(","))
    n = results["fp32"]["num_text_tokens"]
    print(f"default model, perplexity over {n} tokens; greedy agreement over {len(PROMPTS)} x {NUM_TOKENS} tokens")
    print(f"{'mode':11s} {'path':8s} {'ppl':>8s} {'vs fp32':>8s} {'teacher-forced':>15s} {'prefix':>7s}")
    for mode, r in results.items():
        for path in PATHS:
            p = r[path]
            prefix = f"{r['prefix']:7.1%}" if path == "decode" else ""
            print(f"{mode:11s} {path:8s} {p['ppl']:8.3f} {p['ppl_rise']:+8.2%} {p['teacher_forced']:15.1%} {prefix:>7s}")


if __name__ == "__main__":
    main()
