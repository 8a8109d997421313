"""The n-gram proposer: the latest earlier occurrence of the longest matching suffix, k tokens after it;
incremental indexing agrees with a brute-force search on random sequences as they grow; speculative_config's
keys are type-checked, and one prompt lookup bound given alone sets the other (vLLM's rule)."""
from __future__ import annotations

import random

import pytest

from tokenmill.config import SpeculativeConfig
from tokenmill.spec import make_proposer


def _proposer(lo=1, hi=4):
    return make_proposer(SpeculativeConfig("ngram", 4, prompt_lookup_min=lo, prompt_lookup_max=hi))


def brute(tokens, k, lo, hi):
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_the_longest_suffix_and_its_latest_occurrence_win():
    p = _proposer()
    #        0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    assert p.propose("a", seq, 3) == [8, 1, 6]         # "5 6 7" (n=3) occurred at 0..2: its follow
    assert p.propose("b", [1, 2, 3], 2) == []          # nothing repeats
    assert p.propose("c", [4, 4, 4, 4], 2) == [4]      # a run: the latest earlier "4 4 4" is followed by one 4


def test_incremental_index_agrees_with_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        lo, hi = rng.choice([(1, 4), (2, 3), (1, 1), (3, 5)])
        p, tokens = _proposer(lo, hi), []
        for _ in range(120):
            tokens.append(rng.randrange(6))
            k = rng.randrange(1, 6)
            assert p.propose("r", tokens, k) == brute(tokens, k, lo, hi), (trial, tokens)


def test_cut_back_tokens_reset_the_index():
    p = _proposer()
    tokens = [1, 2, 3, 1, 2]
    assert p.propose("r", tokens, 2) == [3, 1]
    assert p.propose("r", [9, 8], 2) == []              # shorter than indexed: rebuilt, no stale match
    p.drop("r")
    assert "r" not in p.indexes


@pytest.mark.parametrize("key, value, match", [
    ("prompt_lookup_min", "2", r"prompt_lookup_min must be an integer or null \(None\), got '2' \(str\)"),
    ("adaptive", "false", r"adaptive must be a boolean \(true or false\), got 'false' \(str\)"),
    ("method", ["ngram"], r"method must be a string, got \['ngram'\] \(list\)"),
    ("num_speculative_tokens", True, r"num_speculative_tokens must be an integer, got True \(bool\)"),
    ("relaxed_delta", "0.1", r"relaxed_delta must be a number, got '0.1' \(str\)")])
def test_speculative_config_values_must_have_their_keys_types(key, value, match):
    with pytest.raises(ValueError, match=f"^speculative_config: {match}"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, key: value})


def test_one_prompt_lookup_bound_sets_the_other_as_in_vllm():
    def lookup(**given):
        c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, **given})
        return c.prompt_lookup_min, c.prompt_lookup_max
    assert lookup() == (1, 4)
    assert lookup(prompt_lookup_min=5) == (5, 5)
    assert lookup(prompt_lookup_max=2) == (2, 2)
    assert lookup(prompt_lookup_min=2, prompt_lookup_max=3) == (2, 3)
    with pytest.raises(ValueError, match="need 1 <= prompt_lookup_min <= prompt_lookup_max, got 3 and 2"):
        lookup(prompt_lookup_min=3, prompt_lookup_max=2)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "relaxed_delta": 0}')

