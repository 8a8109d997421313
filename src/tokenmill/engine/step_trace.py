"""A step trace for diagnosis: with TOKENMILL_STEP_TRACE=FILE set, the engine core appends one JSON line per
observed step period to FILE (the step-time model's observation, beside what the model predicted for it
just before):

    {"t": s since the trace opened, "pid": the engine core's process, "seconds": the period (s),
     "predicted": the model's step time (s), "decode_rows": .., "prefill_tokens": .., "context_reads": ..,
     "running": .., "waiting": ..}

Data-parallel replicas each append to the same FILE (one short write per line); "pid" tells them apart.

Off (no file, no cost beyond one None check a step) when the variable is unset or empty. Lines are
flushed as written, so a trace survives a server that is killed.
"""
from __future__ import annotations

import json
import os
import time
from typing import TextIO

from tokenmill.core.step_time import StepFeatures

ENV_VAR = "TOKENMILL_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str) -> None:
        try:
            self._file: TextIO = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"{ENV_VAR}={path!r}: cannot open it for appending ({e.strerror})") from e
        self._t0 = time.perf_counter()
        self._pid = os.getpid()

    @classmethod
    def from_env(cls) -> "StepTrace | None":
        path = os.environ.get(ENV_VAR, "")
        return cls(path) if path else None

    def record(self, features: StepFeatures, seconds: float, predicted: float, running: int, waiting: int) -> None:
        line = {"t": round(time.perf_counter() - self._t0, 6), "pid": self._pid, "seconds": seconds,
                "predicted": predicted, "decode_rows": features.decode_rows, "prefill_tokens": features.prefill_tokens,
                "context_reads": features.context_reads, "running": running, "waiting": waiting}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
