"""The settings search of `tokenmill tune`: coordinate descent over a small space of engine settings, each
trial a find-peak of the Server scenario; the best trial is the one with the highest peak QPS meeting the
profile's limits (ties: more completed tokens/s).

Coordinate descent: knobs are tried in order (policy first: it changes what the others mean), each over its
values with the other knobs at the best found so far; a value already measured is not measured again.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

# knob -> values tried (EngineArgs field names)
DEFAULT_SPACE: dict[str, list] = {
    "scheduling_policy": ["fcfs", "slo"],
    "max_num_seqs": [8, 16, 32, 64, 256],
    "max_num_batched_tokens": [256, 512, 2048],
    "long_prefill_token_threshold": [0, 64, 256],
}


@dataclass
class Trial:
    settings: dict                       # the knobs' values of this trial
    peak_qps: float | None               # None: no QPS met the limits
    completed_tokens_per_s: float | None # at the peak
    confirmed: bool
    seconds: float
    error: str | None = None             # the trial could not run (e.g. a setting the engine refuses)

    @property
    def score(self) -> tuple[float, float]:
        return (self.peak_qps or 0.0, self.completed_tokens_per_s or 0.0)


@dataclass
class TuneResult:
    best: Trial | None
    trials: list[Trial] = field(default_factory=list)
    stopped_early: bool = False          # trial cap or time budget reached


def parse_space(specs: list[str] | None) -> dict[str, list]:
    """`knob=v1,v2` strings over DEFAULT_SPACE (ints, floats, none, true/false, names, or JSON objects such
    as speculative_config's: `speculative_config=none,{"method": "ngram", "num_speculative_tokens": 4}`),
    each value checked against its EngineArgs field's type."""
    if not specs:
        return dict(DEFAULT_SPACE)
    from tokenmill.config_file import _engine_fields
    known, space = _engine_fields(), {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ValueError(f"search space entry {spec!r}: expected knob=value1,value2")
        if name not in known or name in ("model", "tokenizer"):
            raise ValueError(f"search space entry {spec!r}: {name!r} is not a tunable engine argument")
        try:
            space[name] = [_knob_value(name, v.strip()) for v in _split_values(values)]
        except ValueError as e:
            raise ValueError(f"search space entry {spec!r}: {e}") from None
    return space


def _split_values(text: str) -> list[str]:
    """Split at the commas outside JSON objects and arrays (and their strings)."""
    parts, depth, start, quoted, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            quoted = ch != '"' or escaped
            escaped = ch == "\\" and not escaped
        elif ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth or quoted:
        raise ValueError("unbalanced braces, brackets or quotes")
    return parts + [text[start:]]


def _knob_value(knob: str, text: str):
    """`text` read as a value (_value) that EngineArgs' field `knob` takes (ValueError naming both if not)."""
    from tokenmill.config import check_engine_arg
    value = _value(text)
    check_engine_arg(knob, value)
    return value


def _value(text: str):
    if text.startswith(("{", "[")):
        try:
            return json.loads(text)
        except ValueError as e:
            raise ValueError(f"{text!r} is not valid JSON ({e})") from None
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def coordinate_search(space: dict[str, list], measure: Callable[[dict], Trial], max_trials: int | None = None,
                      time_budget_s: float | None = None, on_trial: Callable[[Trial], None] | None = None) -> TuneResult:
    """measure(settings) -> Trial for the full settings (every knob set). The starting point is each knob's
    first value, except scheduling_policy, which starts at its last ("slo" in the default space)."""
    t0 = time.perf_counter()
    current = {k: v[-1] if k == "scheduling_policy" else v[0] for k, v in space.items()}
    result, seen = TuneResult(None), {}

    def run(settings: dict) -> Trial | None:
        key = json.dumps(settings, sort_keys=True)          # values may be dicts (speculative_config)
        if key in seen:
            return seen[key]
        if (max_trials is not None and len(result.trials) >= max_trials) or (
                time_budget_s is not None and time.perf_counter() - t0 > time_budget_s):
            result.stopped_early = True
            return None
        trial = measure(dict(settings))
        seen[key] = trial
        result.trials.append(trial)
        if trial.error is None and (result.best is None or trial.score > result.best.score):
            result.best = trial
        if on_trial:
            on_trial(trial)
        return trial

    for knob, values in space.items():
        best_value, best_score = current[knob], None
        for value in values:
            trial = run({**current, knob: value})
            if trial is None:
                return result
            if trial.error is None and (best_score is None or trial.score > best_score):
                best_value, best_score = value, trial.score
        current[knob] = best_value
    return result
