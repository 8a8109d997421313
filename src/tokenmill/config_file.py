"""Engine configuration files: what `tokenmill tune` writes and `tokenmill serve --config FILE` /
`LLM(config=FILE)` read.

    {"tokenmill_config": 1,
     "engine_args": {"scheduling_policy": "slo", "max_num_seqs": 24, ...},   # EngineArgs fields only
     "tuned": {...}}                                                         # how they were found (ignored)

Each value must have its EngineArgs field's type (true/false for a boolean, an integer for an int field;
speculative_config a JSON object as --speculative-config takes). Explicit arguments win over the file (LLM
keyword arguments; the engine flags given on the command line, whatever their value).
"""
from __future__ import annotations

import json
import os
from dataclasses import fields

FORMAT_VERSION = 1


def _engine_fields() -> dict:
    from tokenmill.config import EngineArgs
    return {f.name: f for f in fields(EngineArgs)}


def read_engine_args(path: str) -> dict:
    """The engine_args mapping of a config file, checked against EngineArgs' fields."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {path!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"config file {path!r} is not readable JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("engine_args"), dict):
        raise ValueError(f"config file {path!r} must be a JSON object with an \"engine_args\" object "
                         "(as `tokenmill tune` writes)")
    if data.get("tokenmill_config", FORMAT_VERSION) != FORMAT_VERSION:
        raise ValueError(f"config file {path!r} has format {data.get('tokenmill_config')!r}; this tokenmill reads "
                         f"format {FORMAT_VERSION}")
    args, known = data["engine_args"], _engine_fields()
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise ValueError(f"config file {path!r}: unknown engine arguments {unknown}; expected EngineArgs fields "
                         f"such as {sorted(known)[:8]} ...")
    from tokenmill.config import check_engine_arg
    for name, value in args.items():
        try:
            check_engine_arg(name, value)      # its field's type; speculative_config's object as --speculative-config
        except ValueError as e:
            raise ValueError(f"config file {path!r}: {e}") from None
    return dict(args)


def write_config(path: str, engine_args: dict, tuned: dict | None = None) -> str:
    unknown = sorted(set(engine_args) - set(_engine_fields()))
    if unknown:
        raise ValueError(f"not EngineArgs fields: {unknown}")
    payload = {"tokenmill_config": FORMAT_VERSION, "engine_args": engine_args, "tuned": tuned or {}}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path
