"""Incremental detokenization with stop strings: generated token ids in, streamable text out.

One `IncrementalDetokenizer` per completion. Each `append` costs O(ids since the last emitted text +
total stop-string length), never O(output length):

1. `_TextStream` turns ids into text with prefix/read offsets over a short window of recent ids (the scheme
   of vLLM and of `tokenizers.decoders.DecodeStream`). It holds back text while the decoded window ends
   in U+FFFD (a UTF-8 character split over tokens), and decodes a few prompt tokens in front of the first
   output token so SentencePiece-style decoders keep that token's leading space.
2. `_StopMatcher` finds stop strings in the text and holds back any suffix that could still start one,
   so streamed text is never taken back.

Why not `DecodeStream` itself: it cannot release incomplete trailing bytes when a request ends, lets the
prompt's text leak into the output when the prompt's tail decodes to a trailing U+FFFD, raises on a prefix
mismatch, and works only with a Rust tokenizer. The tests check this stream against it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import tokenizers

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first output token (vLLM uses the same count): enough for any
# decoder whose output for a token depends on the tokens before it.
NUM_CONTEXT_TOKENS = 5
_MAX_CONTEXT_SCAN = 64           # prompt tokens looked at to find NUM_CONTEXT_TOKENS not skipped ones

Decode = Callable[[list[int]], str]


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
        decode, skipped_ids = _decoder_for(tokenizer, skip_special_tokens)
        context_ids = _prompt_context(prompt_token_ids, skipped_ids)
        self._stream = _TextStream(decode, context_ids, skipped_ids)
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

    def append(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        """Feeds newly generated ids (one or more, Python ints)."""
        if self._finished:
            return DetokenizerUpdate()
        self._num_output_tokens += len(token_ids)
        delta = self._stream.append(token_ids)
        if self._stops is None:
            return self._emit(delta, None)
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
    """Token ids -> text deltas over a window `ids` of recent token ids.

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
        self._ids = context_ids
        self._prefix_text = decode(context_ids) if context_ids else ""
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: decode the output on its own rather than
            # let a completed prompt character shift the text.
            self._ids, self._prefix_text = [], ""
        self._read_index = len(self._ids)

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
        # A well-formed decoder gives text.startswith(prefix_text); if one does not, slice anyway
        # (as vLLM does) rather than fail the request.
        new_text = text[len(self._prefix_text):]
        del self._ids[:self._read_index]
        self._read_index = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text


class _StopMatcher:
    """Finds stop strings in text fed piece by piece.

    Invariant between calls: `tail` is the shortest suffix of the text seen so far that could still be
    the start of a stop string (each stop string starting earlier was ruled out for good), so a match
    always starts inside `tail + delta`; `tail` is shorter than the longest stop string. The first
    `num_tail_emitted` chars of `tail` were streamed already (all of them with include_stop_str_in_output,
    where nothing is held back; none otherwise).
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"invalid stop strings {stop!r}: expected non-empty strings")
        self._stops = tuple(dict.fromkeys(stop))
        self._first_chars = frozenset(s[0] for s in self._stops)
        self._max_len = max(len(s) for s in self._stops)
        self._include = include_stop_str_in_output
        self._tail = ""
        self._num_tail_emitted = 0

    def feed(self, delta: str, *, can_match: bool, final: bool) -> tuple[str, str | None]:
        """Returns (text to stream, the stop string that matched or None)."""
        old_len = len(self._tail)
        tail = self._tail + delta
        if can_match and delta:
            match = self._first_match(tail, old_len)
            if match is not None:
                start, stop = match
                cut = start + len(stop) if self._include else start
                return tail[self._num_tail_emitted:cut], stop
        keep_from = len(tail) if final else self._held_back_start(tail)
        if self._include:
            new_text = tail[self._num_tail_emitted:]
            self._tail = tail[keep_from:]
            self._num_tail_emitted = len(self._tail)
        else:
            new_text = tail[:keep_from]
            self._tail = tail[keep_from:]
        return new_text, None

    def _first_match(self, tail: str, old_len: int) -> tuple[int, str] | None:
        """The match ending first (ties: starting first) among those ending after tail[:old_len]."""
        best: tuple[int, int, str] | None = None        # (end, start, stop string)
        for stop in self._stops:
            start = tail.find(stop, 0)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _held_back_start(self, tail: str) -> int:
        """Smallest i with tail[i:] a proper prefix of some stop string; len(tail) if none."""
        first_chars = self._first_chars
        for i in range(max(0, len(tail) - self._max_len + 1), len(tail)):
            if tail[i] not in first_chars:
                continue
            suffix = tail[i:]
            if any(len(s) > len(suffix) and s.startswith(suffix) for s in self._stops):
                return i
        return len(tail)


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


def _decoder_for(tokenizer, skip_special_tokens: bool) -> tuple[Decode, frozenset[int]]:
    """(decode(ids) -> str matching tokenizer.decode(ids, skip_special_tokens), ids that decode to nothing).

    Uses the Rust tokenizer directly when the Python wrapper would not change its text (saves the
    wrapper's overhead on every step); any other tokenizer goes through its own `decode`."""
    backend = _rust_backend(tokenizer)
    if backend is None:
        return (lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)), frozenset()
    skipped = _special_ids(tokenizer, backend) if skip_special_tokens else frozenset()
    return partial(backend.decode, skip_special_tokens=skip_special_tokens), skipped


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
    if type(tokenizer)._decode is not TokenizersBackend._decode:
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
