"""Accuracy mode: ROUGE-1/2/L/Lsum (F-measure x 100, mean over samples, Porter stemming, as MLPerf's
evaluation does) and generated length in characters, each checked at >= 99% of a reference
(gen_len within 90-110%).

Needs `rouge-score` (pip install rouge-score). Sentences for ROUGE-Lsum are split on . ! ? followed by
whitespace (MLPerf uses nltk's punkt model, which needs a data download; results can differ slightly).
"""
from __future__ import annotations

import re

from tokenmill.bench.records import RequestRecord, Sample

# MLPerf Llama 3.1 8B (CNN/DailyMail, 13,368 samples) reference accuracy.
MLPERF_CNNDM_TARGETS = {"rouge1": 38.7792, "rouge2": 15.9075, "rougeL": 24.4957, "rougeLsum": 35.793}
MLPERF_CNNDM_GEN_LEN = 8_167_644          # characters over all 13,368 samples
MLPERF_CNNDM_NUM_SAMPLES = 13_368
ROUGE_FRACTION = 0.99
GEN_LEN_RANGE = (0.9, 1.1)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _lsum_form(text: str) -> str:
    return "\n".join(s for s in _SENTENCE_END.split(text.strip()) if s)


def rouge_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean F-measure x 100 of ROUGE-1/2/L/Lsum."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ImportError("accuracy mode needs rouge-score: pip install rouge-score") from None
    keys = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
    scorer = rouge_scorer.RougeScorer(keys, use_stemmer=True)
    sums = dict.fromkeys(keys, 0.0)
    for pred, ref in zip(predictions, references):
        scores = scorer.score(_lsum_form(ref), _lsum_form(pred))
        for k in keys:
            sums[k] += scores[k].fmeasure
    n = max(len(predictions), 1)
    return {k: 100.0 * v / n for k, v in sums.items()}


def check_accuracy(scores: dict[str, float], gen_len: int, targets: dict[str, float],
                   gen_len_target: float | None) -> tuple[bool, list[str]]:
    """Each ROUGE >= 99% of its target; gen_len within 90-110% of its target. Returns (passed, reasons)."""
    reasons = []
    for k, target in targets.items():
        if k in scores and scores[k] < ROUGE_FRACTION * target:
            reasons.append(f"{k} {scores[k]:.4f} < 99% of {target:g} ({ROUGE_FRACTION * target:.4f})")
    if gen_len_target:
        lo, hi = GEN_LEN_RANGE[0] * gen_len_target, GEN_LEN_RANGE[1] * gen_len_target
        if not lo <= gen_len <= hi:
            reasons.append(f"generated length {gen_len} chars outside 90-110% of {gen_len_target:,.0f}")
    return not reasons, reasons


def evaluate(samples: list[Sample], records: list[RequestRecord], targets: dict[str, float] | None = None,
             gen_len_target: float | None = None) -> dict:
    by_index = {s.index: s for s in samples}
    pairs = [(r.text, by_index[r.sample_index].reference) for r in records
             if r.ok and by_index[r.sample_index].reference is not None]
    if not pairs:
        raise ValueError("accuracy mode needs references: dataset rows with 'reference'/'output'/'highlights'")
    preds, refs = [p for p, _ in pairs], [r for _, r in pairs]
    scores = rouge_scores(preds, refs)
    gen_len = sum(len(p) for p in preds)
    passed, reasons = check_accuracy(scores, gen_len, targets or {}, gen_len_target)
    return {"num_scored": len(pairs), "scores": scores, "gen_len_chars": gen_len, "gen_num": len(preds),
            "targets": targets or {}, "gen_len_target": gen_len_target,
            "passed": passed if (targets or gen_len_target) else None, "reasons": reasons}


def accuracy_section(samples: list[Sample], records: list[RequestRecord], dataset: str,
                     targets: dict[str, float] | None = None) -> tuple[list[str], dict]:
    """Markdown lines and the result; CNN/DailyMail defaults to MLPerf's targets (gen_len scaled by sample count)."""
    note = ""
    gen_target = targets.pop("gen_len", None) if targets else None
    if targets is None and dataset == "cnndm":
        targets = dict(MLPERF_CNNDM_TARGETS)
        n = len({r.sample_index for r in records})
        gen_target = MLPERF_CNNDM_GEN_LEN * n / MLPERF_CNNDM_NUM_SAMPLES
        if n != MLPERF_CNNDM_NUM_SAMPLES:
            note = (f"Scored {n} of the {MLPERF_CNNDM_NUM_SAMPLES} MLPerf samples: the generated-length target "
                    f"is scaled to them, and the check is indicative only.")
    acc = evaluate(samples, records, targets, gen_target)
    verdict = {True: "PASS", False: "FAIL", None: "no reference targets given"}[acc["passed"]]
    lines = ["## Accuracy", "", f"Result: **{verdict}**" + (f" ({'; '.join(acc['reasons'])})" if acc["reasons"] else ""),
             "", "| metric | value | target (99%) |", "|---|---|---|"]
    for k, v in acc["scores"].items():
        t = acc["targets"].get(k)
        lines.append(f"| {k} | {v:.4f} | {'' if t is None else f'{t:g} ({0.99 * t:.4f})'} |")
    lines.append(f"| gen_len (chars) | {acc['gen_len_chars']} | "
                 f"{'' if not gen_target else f'{gen_target:,.0f} (90-110%)'} |")
    lines += ["", note, ""] if note else [""]
    return lines, acc


def parse_targets(spec: str | None) -> dict[str, float] | None:
    """'rouge1=38.78,rouge2=15.9,gen_len=8167644' -> dict; None passes through."""
    if not spec:
        return None
    out = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len") or not value:
            raise ValueError(f"bad --accuracy-targets entry {part!r}: expected rouge1|rouge2|rougeL|rougeLsum|gen_len=NUMBER")
        out[key.strip()] = float(value)
    return out
