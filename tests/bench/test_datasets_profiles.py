"""Datasets (synthetic, JSONL, CNN/DailyMail) and profiles / config files."""
import json
import random

import pytest

from tokenmill.bench.datasets import CNNDM_PROMPT, LengthDist, cnndm_dataset, jsonl_dataset, synthetic_dataset
from tokenmill.bench.profiles import apply_conf, conf_lookup, get_profile, parse_conf


def test_length_specs():
    rng = random.Random(0)
    assert LengthDist.parse("64").draw(rng) == 64
    u = LengthDist.parse("10-20")
    assert all(10 <= u.draw(rng) <= 20 for _ in range(100))
    n = LengthDist.parse("normal:50,10")
    assert all(n.draw(rng) >= 1 for _ in range(100))
    for bad in ("x", "20-10", "0", "normal:5"):
        with pytest.raises(ValueError, match="length spec"):
            LengthDist.parse(bad)


def test_synthetic_is_seeded_and_exact():
    a = synthetic_dataset(8, LengthDist.parse("16"), LengthDist.parse("4-9"), vocab_size=1000, seed=1,
                          special_ids=frozenset({500}))
    b = synthetic_dataset(8, LengthDist.parse("16"), LengthDist.parse("4-9"), vocab_size=1000, seed=1)
    assert [s.max_output_tokens for s in a] == [s.max_output_tokens for s in b]
    for s in a:
        assert len(s.prompt) == s.num_prompt_tokens == 16
        assert all(100 <= t < 1000 and t != 500 for t in s.prompt)
        assert s.ignore_eos and s.min_output_tokens == s.max_output_tokens


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "hi", "reference": "hello"}\n\n{"prompt": "yo", "max_tokens": 3}\n')
    ds = jsonl_dataset(p, max_output_tokens=8)
    assert [(s.prompt, s.reference, s.max_output_tokens) for s in ds] == [("hi", "hello", 8), ("yo", None, 3)]
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="prompt"):
        jsonl_dataset(tmp_path / "bad.jsonl", 8)
    with pytest.raises(FileNotFoundError):
        jsonl_dataset(tmp_path / "none.jsonl", 8)


def test_cnndm_prompt(tmp_path):
    p = tmp_path / "cnn.json"
    p.write_text(json.dumps([{"article": "A cat sat.", "highlights": "Cat sits."}]))
    (s,) = cnndm_dataset(p)
    assert s.prompt == CNNDM_PROMPT.format(article="A cat sat.")
    assert s.prompt.startswith("Summarize the following news article in 128 tokens.")
    assert s.prompt.endswith("\n\nSummary:")
    assert (s.max_output_tokens, s.min_output_tokens, s.reference) == (128, 1, "Cat sits.")


def test_profiles():
    p = get_profile("llama3.1-8b")
    assert (p.ttft_limit_ms, p.tpot_limit_ms, p.max_output_tokens, p.greedy, p.prefix_caching) == \
        (2000, 100, 128, True, False)
    assert p.submission_length
    i = get_profile("llama3.1-8b-interactive")
    assert (i.ttft_limit_ms, i.tpot_limit_ms) == (500, 30)
    assert get_profile("custom", ttft_ms=100, tpot_ms=10).tpot_limit_ms == 10
    assert not p.with_dev_length(10, 5).submission_length
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("gpt-5")


def test_conf_lookup_order(tmp_path):
    conf = parse_conf("*.*.min_duration = 1000\nllama3_1-8b.*.min_duration = 2000  # ms\n"
                      "*.Server.min_duration = 3000\nllama3_1-8b.Server.tpot_latency = 90\n")
    assert conf_lookup(conf, "llama3_1-8b", "Server", "min_duration") == "3000"
    assert conf_lookup(conf, "llama3_1-8b", "Offline", "min_duration") == "2000"
    assert conf_lookup(conf, "other", "Offline", "min_duration") == "1000"
    f = tmp_path / "user.conf"
    f.write_text("llama3_1-8b.Server.tpot_latency = 90\n*.Server.min_duration = 30000\n")
    prof = apply_conf(get_profile("llama3.1-8b"), f, "Server")
    assert prof.tpot_limit_ms == 90 and prof.min_duration_s == 30
    with pytest.raises(ValueError, match="config line 1"):
        parse_conf("nonsense")
