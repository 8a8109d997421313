"""Datasets (the QSL): synthetic token prompts, JSONL prompts, and MLPerf's CNN/DailyMail summarization.

Every loader returns a list of `Sample`s; no loader sorts the samples (MLPerf forbids sorting across
the dataset). Lengths are in tokens.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.records import Sample

# MLPerf Llama 3.1 8B prompt (no chat template; greedy; 1..128 new tokens).
CNNDM_PROMPT = ("Summarize the following news article in 128 tokens. Please output the summary only, "
                "without any other text.\n\nArticle:\n{article}\n\nSummary:")
CNNDM_MAX_OUTPUT_TOKENS = 128
CNNDM_MIN_OUTPUT_TOKENS = 1


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed, uniform over [low, high], or normal(mean, std) clipped to >= 1."""
    kind: str                 # "fixed" | "uniform" | "normal"
    a: float                  # fixed value / low / mean
    b: float = 0.0            # high / std

    @classmethod
    def parse(cls, spec: str | int) -> "LengthDist":
        """'64' fixed; '32-128' uniform; 'normal:128,32' normal. Raises ValueError on anything else."""
        s = str(spec).strip()
        try:
            if s.startswith("normal:"):
                mean, std = s[len("normal:"):].split(",")
                dist = cls("normal", float(mean), float(std))
            elif "-" in s:
                low, high = s.split("-")
                dist = cls("uniform", int(low), int(high))
            else:
                dist = cls("fixed", int(s))
        except ValueError:
            raise ValueError(f"bad length spec {spec!r}: expected N, LOW-HIGH or normal:MEAN,STD (tokens)") from None
        if dist.a < 1 or (dist.kind == "uniform" and dist.b < dist.a) or (dist.kind == "normal" and dist.b < 0):
            raise ValueError(f"bad length spec {spec!r}: lengths must be >= 1 and LOW <= HIGH")
        return dist

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    @property
    def is_fixed(self) -> bool:
        return self.kind == "fixed"


def synthetic_dataset(num_samples: int, prompt_len: LengthDist, output_len: LengthDist, vocab_size: int,
                      seed: int = 0, special_ids: frozenset[int] = frozenset(), exact_output: bool = True,
                      ) -> list[Sample]:
    """Random token-id prompts (seeded) with the given length distributions.

    exact_output: ask for exactly the drawn number of output tokens (ignore_eos, min_tokens = max_tokens),
    so throughput does not depend on when a random prompt happens to emit EOS.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    rng = random.Random(seed)
    low = min(100, vocab_size // 2)     # skip the lowest ids, where tokenizers keep control tokens
    samples = []
    for i in range(num_samples):
        n_prompt, n_out = prompt_len.draw(rng), output_len.draw(rng)
        ids: list[int] = []
        while len(ids) < n_prompt:
            tok = rng.randrange(low, vocab_size)
            if tok not in special_ids:
                ids.append(tok)
        samples.append(Sample(i, tuple(ids), n_prompt, n_out, min_output_tokens=n_out if exact_output else 0,
                              ignore_eos=exact_output))
    return samples


def _read_records(path: str | Path) -> list[dict]:
    """Rows of a JSONL file, or of a JSON file holding a list of objects."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file not found: {p}")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(f"{p}: expected a JSON list of objects")
        return rows
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
    return rows


def _count(tokenizer, text: str) -> int | None:
    return None if tokenizer is None else len(tokenizer.encode(text, add_special_tokens=False))


def jsonl_dataset(path: str | Path, max_output_tokens: int, tokenizer=None, limit: int | None = None,
                  ) -> list[Sample]:
    """Rows with "prompt" (text) and optionally "reference" (or "output") and "max_tokens"."""
    samples = []
    for n, row in enumerate(_read_records(path)[:limit]):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}: row {n + 1} has no string field 'prompt'")
        ref = row.get("reference", row.get("output"))
        samples.append(Sample(n, row["prompt"], _count(tokenizer, row["prompt"]),
                              int(row.get("max_tokens", max_output_tokens)), reference=ref))
    return samples


def cnndm_dataset(path: str | Path, tokenizer=None, limit: int | None = None) -> list[Sample]:
    """CNN/DailyMail rows the user brings: {"article", "highlights"} (HF layout) or {"input", "output"}
    (MLPerf's preprocessed cnn_eval.json), formatted with MLPerf's summarization prompt."""
    samples = []
    for n, row in enumerate(_read_records(path)[:limit]):
        article = row.get("article", row.get("input")) if isinstance(row, dict) else None
        if not isinstance(article, str):
            raise ValueError(f"{path}: row {n + 1} has neither 'article' nor 'input'")
        prompt = CNNDM_PROMPT.format(article=article)
        samples.append(Sample(n, prompt, _count(tokenizer, prompt), CNNDM_MAX_OUTPUT_TOKENS,
                              min_output_tokens=CNNDM_MIN_OUTPUT_TOKENS,
                              reference=row.get("highlights", row.get("output"))))
    return samples
