"""Quality of each quantized mode against fp32 on the default model: perplexity and greedy agreement.

Perplexity: of a set of documents, exp(total next-token NLL / tokens scored), each document a sequence of
its own, through the engine's model (`llm.engine.core.runner.model` on hand-built metadata: one sequence,
cache slots 0..T-1, so the LLMs here run with prefix caching off) in two ways, as steps of many rows and
of few rows run them (different attention code, and for fp32 different GEMMs; int8/int4 run the tile
kernels on both; where the CPU has AMX tiles, steps of 32 rows or more take them in bfloat16, and a prompt
chunk of 1,280 rows or more runs one bfloat16 GEMM, quant/tile_kernels.py, as does a longer prefill pass here):
  prefill: one forward pass of the whole text, its rows marked as a prompt chunk's (layers/linear.py);
  decode:  the text in chunks of DECODE_CHUNK tokens over the KV cache, as decode at batch 16 runs
           (--decode-chunk: another size, e.g. 8 for the kernels formats run on steps of a few rows).
The documents (--text): `test` is tests/quant/data/ppl_text.txt alone (about 700 tokens; the test reads it);
`full` (the default) adds benchmarks/data/ppl_documents.txt (eleven documents of other kinds: narrative,
expository, dialogue, technical, news, a letter, a manual, a match report, an interview, a diary), written for
this project: 6,359 tokens scored in all.
Beside each rise: its 95% interval, from the per-token NLL differences against fp32's one pass taken in
blocks of BLOCK tokens (block means, so that neighbouring tokens' correlation is counted), and the mean
KL(fp32 || mode) of the next-token distributions in nats per token (llama.cpp's --kl-divergence measure).
Greedy agreement, for 8 fixed prompts x 32 greedy tokens (ignore EOS), fp32's continuations as reference:
  teacher-forced: the quantized model reads prompt + fp32's continuation; the fraction of the 256
      positions where its argmax equals fp32's token (every position judged in the same context), by
      both paths as above.
  prefix: the quantized model generates freely; tokens equal to fp32's up to the first divergence,
      over all 256 (strict: one early flip discounts the rest of that prompt).

    .venv/bin/python benchmarks/quant_quality.py [--modes int8,int4,w8a8,fp8,fp8-exact,nvfp4,nvfp4-exact,mxfp4,mxfp4-exact]
        [--checkpoints fp8-gptq=DIR,...]      # e.g. DIR from `tokenmill quantize --out DIR`

tests/quant/test_quality.py checks, for both paths: perplexity at most 3% above fp32, teacher-forced
agreement >= 90%.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re

import torch

TEXT_PATH = os.path.join(os.path.dirname(__file__), "..", "tests", "quant", "data", "ppl_text.txt")
DOCUMENTS_PATH = os.path.join(os.path.dirname(__file__), "data", "ppl_documents.txt")   # split at "---" lines
BLOCK = 32
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


def parse_checkpoints(ap: argparse.ArgumentParser, text: str) -> dict[str, str]:
    """--checkpoints' NAME=DIR,... as {NAME: DIR} (also read by decode_latency.py and offline_throughput.py);
    anything else, or a DIR that is not a directory, is the parser's error."""
    items = [item for item in text.split(",") if item]
    bad = [item for item in items if "=" not in item or not os.path.isdir(item.split("=", 1)[1])]
    if bad:
        ap.error(f"--checkpoints takes NAME=DIR items, DIR a checkpoint directory; got {bad}")
    return dict(item.split("=", 1) for item in items)


def make_llm(mode: str | None, checkpoints: dict[str, str] | None = None):
    """mode: a name in `checkpoints` (the pre-quantized checkpoint directory it names, e.g. one written by
    `tokenmill quantize`), a weight quantization method, or "fp8-kv" / "bf16-kv" (float32 weights, an FP8 or
    bfloat16 KV cache, which both paths read: the native prefill kernel reads a chunk's own new keys and values
    as cached).
    The suffix "-exact" (on "fp8", "nvfp4", "mxfp4" or an FP8 checkpoint's name) turns the format's fast
    mode off: its float32-activation reference (quant.exact_mode); without it the fast mode runs where the
    native kernels exist (FP4: int8 activations at every step; FP8: bfloat16 GEMMs above 16 rows)."""
    from tokenmill import LLM
    from tokenmill.quant import exact_mode
    base = mode.removesuffix("-exact") if mode else mode
    exact = mode is not None and mode.endswith("-exact")
    with exact_mode("fp8" if checkpoints and base in checkpoints else base) if exact else contextlib.nullcontext():
        if checkpoints and base in checkpoints:
            return LLM(checkpoints[base], enable_prefix_caching=False, kv_cache_memory_bytes=1 << 27)
        if mode in ("fp8-kv", "bf16-kv"):
            return LLM(kv_cache_dtype={"fp8-kv": "fp8", "bf16-kv": "bfloat16"}[mode], enable_prefix_caching=False,
                       kv_cache_memory_bytes=1 << 27)
        return LLM(quantization=base, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 27)


@torch.inference_mode()
def forward_logits(llm, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """token_ids [T] -> next-token logits [T, vocab] float32 of one sequence: one prefill, or chunks of
    `chunk` tokens each attending to the cache the earlier chunks wrote."""
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    from tokenmill.layers.linear import PrefillRows, step_prefill_rows
    model = llm.engine.core.runner.model
    n = len(token_ids)
    prefill = PrefillRows.of(n, list(range(n))) if chunk is None else None   # one pass: a prompt's rows
    chunk = chunk or n
    slots, ids, out = torch.arange(n), torch.tensor(token_ids), []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = AttentionMetadata(slot_mapping=slots[start:end], seqs=[SeqSpan(0, end - start, end, slots[:end])])
        with step_prefill_rows(prefill):
            hidden = model(ids[start:end], torch.arange(start, end), meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def load_texts(text: str) -> list[str]:
    """text: "test" (the test's text alone) or "full" (it and benchmarks/data/ppl_documents.txt's documents)."""
    with open(TEXT_PATH, encoding="utf-8") as f:
        texts = [f.read()]
    if text == "full":
        with open(DOCUMENTS_PATH, encoding="utf-8") as f:
            texts += [d.strip() for d in re.split(r"^---$", f.read(), flags=re.M) if d.strip()]
    elif text != "test":
        raise ValueError(f"text must be 'test' or 'full', got {text!r}")
    return texts


def log_probs(llm, documents: list[list[int]], chunk: int | None = None) -> list[torch.Tensor]:
    """Each document [T] -> its next-token log-probabilities [T - 1, vocab] float32."""
    return [torch.log_softmax(forward_logits(llm, ids, chunk)[:-1].float(), -1) for ids in documents]


def token_nll(documents: list[list[int]], logp: list[torch.Tensor]) -> torch.Tensor:
    """[tokens scored] the NLL of each next token, the documents one after another."""
    return torch.cat([-lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
                      for ids, lp in zip(documents, logp)])


def compare(nll: torch.Tensor, ref_nll: torch.Tensor, logp, ref_logp) -> dict[str, float]:
    """Perplexity, its rise over the reference's with a 95% interval, and the mean KL(ref || this)."""
    delta = (nll - ref_nll).double()
    blocks = delta[: len(delta) // BLOCK * BLOCK].view(-1, BLOCK).mean(1)
    half = 1.96 * blocks.std().item() / math.sqrt(len(blocks)) if len(blocks) > 1 else float("nan")
    mean = delta.mean().item()
    kl = torch.cat([(r.exp() * (r - lp)).sum(-1) for r, lp in zip(ref_logp, logp)]).mean().item()
    return dict(ppl=math.exp(nll.double().mean().item()), ppl_rise=math.expm1(mean),
                rise_low=math.expm1(mean - half), rise_high=math.expm1(mean + half), kl=kl)


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


def evaluate(modes: list[str], full: bool = True, text_tokens: int | None = None, text: str = "test",
             checkpoints: dict[str, str] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {path: {ppl, ppl_rise, rise_low, rise_high, kl, teacher_forced}}, plus "prefix"} with "fp32"
    as the reference: its one-pass perplexity and greedy tokens (its chunked pass, shown too, differs only by
    float rounding). full=False leaves out what only the printed table shows (fp32's own paths, each mode's
    free-running prefix agreement): tests/quant/test_quality.py's checks. text: the documents (load_texts);
    text_tokens: each document cut to its first that many tokens (None: whole); checkpoints: mode name ->
    a pre-quantized checkpoint directory of the default model, measured as that mode."""
    llm = make_llm(None)
    documents = [llm.tokenizer.encode(t)[:text_tokens] for t in load_texts(text)]
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ref_logp = log_probs(llm, documents)
    ref_nll, ref_out = token_nll(documents, ref_logp), greedy(llm, prompt_ids)

    def measure(llm, path: str) -> dict[str, float]:
        logp = log_probs(llm, documents, chunk_of(path))
        return dict(compare(token_nll(documents, logp), ref_nll, logp, ref_logp),
                    teacher_forced=teacher_forced_agreement(llm, prompt_ids, ref_out, chunk_of(path)))

    results = {"fp32": {path: measure(llm, path) for path in (PATHS if full else ())}}
    results["fp32"].update(prefix=1.0, num_text_tokens=len(ref_nll), num_documents=len(documents))
    del llm
    for mode in modes:
        llm = make_llm(mode, checkpoints)
        results[mode] = {path: measure(llm, path) for path in PATHS}
        if full:
            results[mode]["prefix"] = prefix_agreement(greedy(llm, prompt_ids), ref_out)
        del llm
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="int8,int4,w8a8")
    ap.add_argument("--text", default="full", choices=["test", "full"])
    ap.add_argument("--decode-chunk", type=int, default=DECODE_CHUNK,
                    help="tokens per step of the decode path (rows of each step)")
    ap.add_argument("--checkpoints", default="",
                    help="NAME=DIR,...: pre-quantized checkpoints of the default model (e.g. written by "
                         "`tokenmill quantize`), measured as modes NAME after --modes")
    args = ap.parse_args()
    checkpoints = parse_checkpoints(ap, args.checkpoints)
    if args.decode_chunk < 1:
        ap.error(f"--decode-chunk must be >= 1, got {args.decode_chunk}")
    PATHS["decode"] = args.decode_chunk
    modes = [m for m in args.modes.split(",") if m] + list(checkpoints)
    results = evaluate(modes, text=args.text, checkpoints=checkpoints)
    n, docs = results["fp32"]["num_text_tokens"], results["fp32"]["num_documents"]
    print(f"default model, perplexity over {n} tokens in {docs} documents; greedy agreement over "
          f"{len(PROMPTS)} x {NUM_TOKENS} tokens")
    print(f"{'mode':11s} {'path':8s} {'ppl':>8s} {'vs fp32':>8s} {'95% interval':>18s} {'KL nats':>8s} "
          f"{'teacher-forced':>15s} {'prefix':>7s}")
    for mode, r in results.items():
        for path in PATHS:
            p = r[path]
            prefix = f"{r['prefix']:7.1%}" if path == "decode" else ""
            interval = f"[{p['rise_low']:+.2%}, {p['rise_high']:+.2%}]"
            print(f"{mode:11s} {path:8s} {p['ppl']:8.3f} {p['ppl_rise']:+8.2%} {interval:>18s} {p['kl']:8.5f} "
                  f"{p['teacher_forced']:15.1%} {prefix:>7s}")


if __name__ == "__main__":
    main()
