"""Validated per-request generation parameters.

Every field is checked in `__post_init__`; a bad value raises `ValueError` naming the field, the value and
what was expected, so the server can turn it into a 400 without touching the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Upper bound on top-k logprobs per token; the server exposes a configurable lower limit.
MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy (as vLLM does): dividing logits by them overflows.
GREEDY_TEMPERATURE_EPS = 1e-5


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

    def __post_init__(self) -> None:
        # stop: a str, None or any iterable of str becomes a tuple; stop_token_ids: None or iterable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", _as_tuple("stop", self.stop, "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids",
                           _as_tuple("stop_token_ids", self.stop_token_ids, "a list of token ids"))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _int_at_least("n", self.n, 1)
        if not (_is_number(self.temperature) and 0.0 <= self.temperature < math.inf):
            _fail("temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            _fail("top_p", self.top_p, "a number in (0, 1]")
        _int_at_least("top_k", self.top_k, 0, "an integer >= 1, or 0 / -1 to disable")
        _number_in("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1]")
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf):
            _fail("repetition_penalty", self.repetition_penalty, "a number > 0 (1 disables it)")
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "a number in [-2, 2]")
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "a number in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            _fail("seed", self.seed, "an integer or None")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                _fail("stop", self.stop, "non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                _fail("stop_token_ids", self.stop_token_ids, "non-negative integers")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                _fail("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def replace(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def _as_tuple(name: str, value, expected: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        _fail(name, value, expected)
    return tuple(value)


def _fail(name: str, value, expected: str):
    raise ValueError(f"invalid sampling parameter {name}={value!r}: expected {expected}")


def _int_at_least(name: str, value, low: int, expected: str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(name, value, expected or f"an integer >= {low}")


def _number_in(name: str, value, low: float, high: float, expected: str) -> None:
    if not (_is_number(value) and low <= value <= high):
        _fail(name, value, expected)
