"""Incremental detokenization with stop strings: generated token ids in, streamable text out.

One `IncrementalDetokenizer` per completion. Each `append` costs O(ids since the last emitted text + new
characters), amortized, never O(output length) or O(stop-string length^2):

1. A text stream turns ids into text with prefix/read offsets over a short window of recent ids (the
   scheme of vLLM and of `tokenizers.decoders.DecodeStream`). It holds back text while the decoded window
   ends in U+FFFD (a UTF-8 character split over tokens), and decodes a few prompt tokens in front of the
   first output token so SentencePiece-style decoders keep that token's leading space.
   `_LibraryTextStream` runs DecodeStream itself for Rust tokenizers, adding what it lacks: `flush()` of
   incomplete trailing bytes when a request ends, dropping skipped special ids before they grow its
   window, a prompt context that cannot leak prompt text, and no exception on a prefix mismatch.
   `_TextStream` is the same scheme in Python, for any other tokenizer and as that fallback.
2. `_StopMatcher` finds stop strings in the text and holds back any suffix that could still start one,
   so streamed text is never taken back.
"""
from __future__ import annotations

import collections
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output token (vLLM uses the same count): enough for any
# decoder whose output for a token depends on the tokens before it.
NUM_CONTEXT_TOKENS = 5
_MAX_CONTEXT_SCAN = 64           # prompt tokens looked at to find NUM_CONTEXT_TOKENS not skipped ones

Decode = Callable[[list[int]], str]


def _decode_stream_takes_ids() -> bool:
    try:
        DecodeStream(ids=[], skip_special_tokens=True)     # `ids` (prompt context) is new in tokenizers 0.22
    except TypeError:
        return False
    return True


_DECODE_STREAM_TAKES_IDS = _decode_stream_takes_ids()


@dataclass(slots=True)
class DetokenizerUpdate:
    new_text: str = ""                 # safe to stream now; `IncrementalDetokenizer.text` grew by exactly this
    stop_string: str | None = None     # the stop string that matched: the request must finish now


class IncrementalDetokenizer:
    """Detokenizes one completion as its tokens arrive, and finds its stop strings.

    Invariants, after every call:
    - `text` is the concatenation of all `new_text` returned so far and never shrinks.
    - Without stop strings, once `finish()` ran: `text == tokenizer.decode(output_ids, skip_special_tokens)`
      for a byte-level BPE tokenizer; for a SentencePiece-style one the first token keeps its leading space
      when the prompt has text before it (as `decode(prompt_ids + output_ids)` shows it).
    - `new_text` never ends in an incomplete UTF-8 character; until `finish()` it holds back any suffix
      that could still begin a stop string (unless include_stop_str_in_output: nothing is taken back then).
    - A stop string matches only if it ends in text from an `append` that brought the output to at least
      `min_tokens` tokens. When several could match, the one that ends first wins (ties: the longer one),
      so the result does not depend on how many tokens each `append` carries. On a match `text` ends just
      before the stop string (just after it with include_stop_str_in_output), and later calls are ignored.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self._stream = _make_text_stream(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stops = _StopMatcher(stop, include_stop_str_in_output) if stop else None
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        self._text_parts: list[str] = []
        self._stop_string: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text streamed so far (O(length) to build; stream `new_text` instead on the hot path)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `finish()` ran; later appends return empty updates."""
        return self._finished

    @property
    def has_stop_strings(self) -> bool:
        return self._stops is not None

    def append(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feeds newly generated ids (one or more, Python ints; a list or tuple)."""
        if self._finished:
            return DetokenizerUpdate()
        self._num_output_tokens += len(token_ids)
        delta = self._stream.append(token_ids)
        if self._stops is None:
            if delta:
                self._text_parts.append(delta)
            return DetokenizerUpdate(delta)
        can_match = self._num_output_tokens >= self._min_tokens
        new_text, stop_string = self._stops.feed(delta, can_match=can_match, final=False)
        return self._emit(new_text, stop_string)

    def finish(self) -> DetokenizerUpdate:
        """The request ended for another reason (EOS, stop token, length, abort): releases held-back text,
        including incomplete trailing bytes as U+FFFD, exactly as `decode` renders them."""
        if self._finished:
            return DetokenizerUpdate()
        delta = self._stream.flush()
        if self._stops is None:
            update = self._emit(delta, None)
        else:
            can_match = self._num_output_tokens >= self._min_tokens
            update = self._emit(*self._stops.feed(delta, can_match=can_match, final=True))
        self._finished = True
        return update

    def _emit(self, new_text: str, stop_string: str | None) -> DetokenizerUpdate:
        if new_text:
            self._text_parts.append(new_text)
        if stop_string is not None:
            self._stop_string = stop_string
            self._finished = True
        return DetokenizerUpdate(new_text, stop_string)


class _TextStream:
    """Token ids -> text deltas over a window `ids` of recent token ids, for any tokenizer's `decode`.

    Invariants: `prefix_text == decode(ids[:read_index])` is text already emitted (or prompt context);
    `ids[read_index:]` are ids whose text is not emitted yet. On each emission the window restarts at the
    old read_index, so its first token's text was emitted by an earlier window in which it was not first:
    a decoder that treats the first token specially (Metaspace drops its leading space) never changes
    emitted text. Skipped special ids never enter the window (they decode to nothing), so long runs of
    them (ignore_eos benchmarks) keep the window short.
    """

    def __init__(self, decode: Decode, context_ids: list[int], skipped_ids: frozenset[int]) -> None:
        self._decode = decode
        self._skipped_ids = skipped_ids
        self._ids = list(context_ids)
        self._prefix_text = decode(self._ids) if self._ids else ""
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: decode the output on its own rather than
            # let a completed prompt character shift the text.
            self._ids, self._prefix_text = [], ""
        self._read_index = len(self._ids)

    @property
    def window_size(self) -> int:
        return len(self._ids)

    def append(self, token_ids: Sequence[int]) -> str:
        if self._skipped_ids:
            token_ids = [t for t in token_ids if t not in self._skipped_ids]
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""          # no new text yet, or the last character is still incomplete
        return self._advance(text)

    def flush(self) -> str:
        """Text of the unread ids, whatever it is (incomplete bytes show as U+FFFD)."""
        if self._read_index == len(self._ids):
            return ""
        text = self._decode(self._ids)
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        # A well-behaved decoder gives text.startswith(prefix_text). Byte-fallback decoders do not when a
        # stray byte token turns an emitted character into U+FFFDs; slice anyway (as vLLM does): streamed
        # text is never taken back.
        new_text = text[len(self._prefix_text):]
        del self._ids[:self._read_index]
        self._read_index = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text


class _LibraryTextStream:
    """The same scheme run by `tokenizers.decoders.DecodeStream` (both decodes of a step inside one Rust
    call: several times cheaper per token than `_TextStream`), plus a mirror of its window: `read_ids`
    (ids whose text is emitted) and `unread_ids` (ids not emitted yet). The mirror serves `flush()`, and
    the switch to `_TextStream` when DecodeStream raises on a prefix mismatch (see `_TextStream._advance`).
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool, context_ids: list[int],
                 skipped_ids: frozenset[int]) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._skipped_ids = skipped_ids
        if context_ids and backend.decode(context_ids, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            context_ids = []          # the prompt ends inside a character: see _TextStream
        self._read_ids = context_ids
        self._unread_ids: list[int] = []
        self._stream = DecodeStream(ids=context_ids, skip_special_tokens=skip_special_tokens)
        self._fallback: _TextStream | None = None

    @property
    def window_size(self) -> int:
        if self._fallback is not None:
            return self._fallback.window_size
        return len(self._read_ids) + len(self._unread_ids)

    def append(self, token_ids: Sequence[int]) -> str:
        if self._fallback is not None:
            return self._fallback.append(token_ids)
        if len(token_ids) == 1:                   # the common case, kept cheap: one int, no list copies
            step_arg = token_ids[0]
            if step_arg in self._skipped_ids:
                return ""
        else:
            token_ids = step_arg = [t for t in token_ids if t not in self._skipped_ids]
            if not token_ids:
                return ""
        try:
            text = self._stream.step(self._backend, step_arg)
        except Exception:             # the library's prefix mismatch; other errors recur in _TextStream
            return self._switch_to_python(token_ids)
        if text is None:
            self._unread_ids += token_ids
            return ""
        self._read_ids = self._unread_ids + list(token_ids) if self._unread_ids else list(token_ids)
        self._unread_ids = []                                  # read_ids: DecodeStream's new window
        return text

    def flush(self) -> str:
        if self._fallback is not None:
            return self._fallback.flush()
        if not self._unread_ids:
            return ""
        prefix_text = self._decode(self._read_ids)
        text = self._decode(self._read_ids + self._unread_ids)
        return text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, self._skip)

    def _switch_to_python(self, token_ids: Sequence[int]) -> str:
        self._fallback = _TextStream(self._decode, self._read_ids, self._skipped_ids)
        return self._fallback.append(self._unread_ids + list(token_ids))


class _StopMatcher:
    """Finds stop strings in text fed piece by piece, with an Aho-Corasick automaton over them: O(1)
    amortized per character whatever the number and length of the stop strings (a naive rescan of
    the held-back text costs O(stop length^2) per step on text like "aaaa" against the stop "aaaaa...b").

    Invariant between calls: `state` is the automaton node of the longest suffix of the text so far that
    is a prefix of some stop string. Every stop string starting earlier was ruled out for good, so
    `held` (that suffix, depth[state] chars) is all the text that could still become part of a match;
    without include_stop_str_in_output it has not been streamed yet, with it nothing is held back.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"invalid stop strings {stop!r}: expected non-empty strings")
        self._automaton = _AUTOMATA.get(tuple(dict.fromkeys(stop)))
        self._include = include_stop_str_in_output
        self._state = 0
        self._held = ""

    def feed(self, delta: str, *, can_match: bool, final: bool) -> tuple[str, str | None]:
        """Returns (text to stream, the stop string that matched or None)."""
        automaton = self._automaton
        if self._state == 0 and automaton.first_char_re.search(delta) is None:
            return delta, None           # the common case: nothing held, and no stop string starts here
        goto, fail, longest_match = automaton.goto, automaton.fail, automaton.longest_match
        state = self._state
        for pos, char in enumerate(delta):
            next_state = goto[state].get(char)
            while next_state is None and state:
                state = fail[state]
                next_state = goto[state].get(char)
            state = next_state or 0
            stop = longest_match[state]
            if stop is not None and can_match:         # the first stop string to complete wins
                if self._include:
                    return delta[:pos + 1], stop
                text = self._held + delta[:pos + 1]
                return text[:len(text) - len(stop)], stop
        self._state = state
        while state and not goto[state]:   # a whole stop string let through before min_tokens: emit it
            state = fail[state]
        text = self._held + delta
        held_from = len(text) - (0 if final else automaton.depth[state])
        new_text = delta if self._include else text[:held_from]
        self._held = text[held_from:]
        return new_text, None


@dataclass(frozen=True)
class _StopAutomaton:
    """Aho-Corasick automaton; node 0 is the root (the empty string), each node a prefix of a stop string."""
    goto: tuple[dict[str, int], ...]      # node -> {char: child node}
    fail: tuple[int, ...]                 # node -> node of its longest proper suffix that is a node
    depth: tuple[int, ...]                # node -> length of its string
    longest_match: tuple[str | None, ...]  # node -> longest stop string that is a suffix of it, if any
    first_char_re: re.Pattern             # matches any first character of a stop string


class _AutomatonCache:
    """The least recently used automata, holding at most `max_nodes` nodes in all (a larger one is built
    but not kept), so memory stays bounded however many distinct stop strings requests bring. Thread-safe."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.num_nodes = 0                  # nodes of the automata in `_entries`, always <= max_nodes
        self._entries: collections.OrderedDict[tuple[str, ...], _StopAutomaton] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, stops: tuple[str, ...]) -> _StopAutomaton:
        with self._lock:
            automaton = self._entries.get(stops)
            if automaton is not None:
                self._entries.move_to_end(stops)
                return automaton
        automaton = _build_automaton(stops)     # outside the lock: other threads' lookups go on
        self._keep(stops, automaton)
        return automaton

    def _keep(self, stops: tuple[str, ...], automaton: _StopAutomaton) -> None:
        size = len(automaton.goto)
        with self._lock:
            if size > self.max_nodes or stops in self._entries:
                return
            self._entries[stops] = automaton
            self.num_nodes += size
            while self.num_nodes > self.max_nodes:
                _, evicted = self._entries.popitem(last=False)
                self.num_nodes -= len(evicted.goto)


# A node takes 250 to 350 bytes (its dict and key): this many keep the cache under about 22 MiB. It holds
# at least 15 automata of the most stop characters SamplingParams allows (MAX_STOP_CHARS_TOTAL), and
# thousands of typical ones; the n completions of a request share one.
MAX_CACHED_AUTOMATON_NODES = 65_536
_AUTOMATA = _AutomatonCache(MAX_CACHED_AUTOMATON_NODES)


def _build_automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    goto: list[dict[str, int]] = [{}]
    depth, terminal = [0], [None]
    for stop in stops:
        node = 0
        for char in stop:
            child = goto[node].get(char)
            if child is None:
                child = goto[node][char] = len(goto)
                goto.append({})
                depth.append(depth[node] + 1)
                terminal.append(None)
            node = child
        terminal[node] = stop
    fail, longest_match = [0] * len(goto), list(terminal)
    queue = collections.deque(goto[0].values())          # breadth first: a node's fail is done before it
    while queue:
        node = queue.popleft()
        for char, child in goto[node].items():
            suffix = fail[node]
            while suffix and char not in goto[suffix]:
                suffix = fail[suffix]
            fail[child] = goto[suffix].get(char, 0)
            if longest_match[child] is None:
                longest_match[child] = longest_match[fail[child]]
            queue.append(child)
    first_chars = "".join(re.escape(char) for char in goto[0])
    return _StopAutomaton(tuple(goto), tuple(fail), tuple(depth), tuple(longest_match),
                          re.compile(f"[{first_chars}]"))


def _prompt_context(prompt_token_ids: Sequence[int], skipped_ids: frozenset[int]) -> list[int]:
    """The last NUM_CONTEXT_TOKENS prompt ids that decode to text (skipped special ids dropped)."""
    context: list[int] = []
    start = max(0, len(prompt_token_ids) - _MAX_CONTEXT_SCAN)
    for token_id in reversed(prompt_token_ids[start:]):
        if token_id not in skipped_ids:
            context.append(token_id)
            if len(context) == NUM_CONTEXT_TOKENS:
                break
    context.reverse()
    return context


def _make_text_stream(tokenizer, prompt_token_ids: Sequence[int],
                      skip_special_tokens: bool) -> _TextStream | _LibraryTextStream:
    """DecodeStream when the tokenizer is (or wraps, without changing its text) a Rust `tokenizers.Tokenizer`;
    otherwise `_TextStream` over the tokenizer's own `decode`."""
    backend = _rust_backend(tokenizer) if _DECODE_STREAM_TAKES_IDS else None
    if backend is None:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _TextStream(decode, _prompt_context(prompt_token_ids, frozenset()), frozenset())
    skipped_ids = _special_ids(tokenizer, backend) if skip_special_tokens else frozenset()
    context_ids = _prompt_context(prompt_token_ids, skipped_ids)
    return _LibraryTextStream(backend, skip_special_tokens, context_ids, skipped_ids)


def _rust_backend(tokenizer) -> tokenizers.Tokenizer | None:
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    # A subclass that post-processes decoded text must keep its own decode.
    if getattr(type(tokenizer), "_decode", None) is not TokenizersBackend._decode:
        return None
    return backend


# tokenizer -> (vocab size with added tokens, ids of its special added tokens); rebuilt if tokens are added.
_SPECIAL_IDS_CACHE: "weakref.WeakKeyDictionary[object, tuple[int, frozenset[int]]]" = weakref.WeakKeyDictionary()


def _special_ids(tokenizer, backend: tokenizers.Tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the added tokens marked special."""
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    cached = _SPECIAL_IDS_CACHE.get(tokenizer)
    if cached is not None and cached[0] == vocab_size:
        return cached[1]
    ids = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    _SPECIAL_IDS_CACHE[tokenizer] = (vocab_size, ids)
    return ids
