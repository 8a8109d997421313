"""Validated per-request generation parameters.

Every field is checked in `__post_init__`; a bad value raises `ValueError` naming the field, the value and
what was expected, so the server can turn it into a 400 without touching the engine.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

# Upper bound on top-k logprobs per token; the server exposes a configurable lower limit.
MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy (as vLLM does): dividing logits by them overflows.
GREEDY_TEMPERATURE_EPS = 1e-5
# The largest values the float32 sampler computes without overflow or NaN for any finite logit: 1/T and
# logit * r, logit / r stay finite normal floats. (The server holds requests to OpenAI's narrower ranges.)
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
# Largest top_k and token id that fit the int64 tensors the sampler builds (both are further held to the
# vocabulary when the engine admits the request, see check_for_model).
MAX_INT64 = 2**63 - 1
# Stop conditions every request may carry (OpenAI allows 4 stop strings). The detokenizer builds an automaton
# with a node per stop character on the engine thread, and every generated token is looked up in
# stop_token_ids: these bounds keep both small whatever a request sends.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_CHARS_TOTAL = 4096
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1                              # completions per prompt
    temperature: float = 1.0                # 0 (or < GREEDY_TEMPERATURE_EPS) means greedy
    top_p: float = 1.0                      # nucleus mass in (0, 1]
    top_k: int = 0                          # 0 or -1: off
    min_p: float = 0.0                      # in [0, 1]
    repetition_penalty: float = 1.0         # > 0; 1 is off (divides positive logits of seen tokens)
    presence_penalty: float = 0.0           # in [-2, 2]
    frequency_penalty: float = 0.0          # in [-2, 2]
    seed: int | None = None                 # per-request generator: same tokens whatever shares the batch
    stop: tuple[str, ...] = ()              # stop strings, removed from the text
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16             # None: up to the context window
    min_tokens: int = 0                     # EOS and stop tokens are masked until this many were generated
    ignore_eos: bool = False
    logprobs: int | None = None             # top-k logprobs per generated token (0: only the sampled one)
    skip_special_tokens: bool = True
    # Latency targets (MLPerf's definitions, from arrival): TTFT and per-request TPOT. The server counts
    # whether each request met them (goodput); None: no target.
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None

    def __post_init__(self) -> None:
        # stop: a str, None or any iterable of str becomes a tuple; stop_token_ids: None or iterable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", _as_tuple("stop", self.stop, "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", tuple(builtin_number(t) for t in _as_tuple(
            "stop_token_ids", self.stop_token_ids, "a list of token ids")))
        for name in _NUMBER_FIELDS:        # numpy (or other numbers.Real) scalars as the Python int / float
            object.__setattr__(self, name, builtin_number(getattr(self, name)))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _int_at_least("n", self.n, 1)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):    # "false" or None would read as true / false
                _fail(name, getattr(self, name), "True or False")
        if not (_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            _fail("temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            _fail("top_p", self.top_p, "a number in (0, 1]")
        _int_at_least("top_k", self.top_k, 0, "an integer >= 1, or 0 / -1 to disable")
        if self.top_k > MAX_INT64:
            _fail("top_k", self.top_k, "an integer in [1, vocabulary size], or 0 / -1 to disable")
        _number_in("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not (_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high):
            _fail("repetition_penalty", self.repetition_penalty, f"a number in [{low:g}, {high:g}] (1 disables it)")
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "a number in [-2, 2]")
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a number in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            _fail("seed", self.seed, "an integer or None")
        _check_stop_strings(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", self.stop_token_ids,
                  f"at most {MAX_STOP_TOKEN_IDS} token ids (got {len(self.stop_token_ids)})")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= MAX_INT64:
                _fail("stop_token_ids", self.stop_token_ids, "token ids (non-negative integers)")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("ttft_target_ms", "tpot_target_ms"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and 0.0 < value < math.inf):
                _fail(name, value, "a number of milliseconds > 0, or None for no target")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                _fail("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")

    def check_for_model(self, vocab_size: int, eos_token_ids) -> None:
        """The checks that need the model: top_k and stop_token_ids inside the vocabulary, and min_tokens
        satisfiable (while it masks EOS and the stop ids, some token must remain). ValueError naming the field."""
        if self.top_k > vocab_size:
            _fail("top_k", self.top_k, f"an integer in [1, {vocab_size}] (the vocabulary size), or -1 to disable")
        outside = [t for t in self.stop_token_ids if t >= vocab_size]
        if outside:
            _fail("stop_token_ids", outside, f"token ids inside the vocabulary [0, {vocab_size})")
        if self.min_tokens > 0:
            banned = set(self.stop_token_ids) | {t for t in eos_token_ids if 0 <= t < vocab_size}
            if len(banned) >= vocab_size:
                raise ValueError(f"min_tokens ({self.min_tokens}) cannot be satisfied: EOS and stop_token_ids "
                                 f"ban all {vocab_size} tokens of the vocabulary until then")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def replace(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


_NUMBER_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "ttft_target_ms",
                  "tpot_target_ms")


def builtin_number(x):
    """A non-builtin integral / real scalar (numpy's, say) as int / float; anything else unchanged (bools
    too: they are rejected where a number is expected)."""
    if isinstance(x, (int, float)) or type(x).__name__ in ("bool", "bool_"):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    return x


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _as_tuple(name: str, value, expected: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        _fail(name, value, expected)
    return tuple(value)


def _check_stop_strings(stop: tuple) -> None:
    """At most MAX_STOP_STRINGS non-empty strings, each of at most MAX_STOP_STRING_CHARS characters and
    MAX_STOP_CHARS_TOTAL in all; the count is checked first, so a huge list costs nothing more."""
    if len(stop) > MAX_STOP_STRINGS:
        _fail("stop", stop, f"at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})")
    for s in stop:
        if not isinstance(s, str) or s == "":
            _fail("stop", stop, "non-empty strings")
        if len(s) > MAX_STOP_STRING_CHARS:
            _fail("stop", stop, f"stop strings of at most {MAX_STOP_STRING_CHARS} characters each (one has {len(s)})")
    total = sum(map(len, stop))
    if total > MAX_STOP_CHARS_TOTAL:
        _fail("stop", stop, f"stop strings of at most {MAX_STOP_CHARS_TOTAL} characters in all (got {total})")


def _fail(name: str, value, expected: str):
    raise ValueError(f"invalid sampling parameter {name}={_short_repr(value)}: expected {expected}")


def _short_repr(value, limit: int = 120) -> str:
    """repr of a bad value, cut short (a stop list can be megabytes) and safe to encode as UTF-8."""
    text = repr(value)
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _int_at_least(name: str, value, low: int, expected: str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(name, value, expected or f"an integer >= {low}")


def _number_in(name: str, value, low: float, high: float, expected: str) -> None:
    if not (_is_number(value) and low <= value <= high):
        _fail(name, value, expected)
