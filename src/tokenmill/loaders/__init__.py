"""Model sources: a Hugging Face directory or a GGUF file, seen through one interface."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass
class ModelSource:
    path: str
    hf_config: object                                        # transformers.PretrainedConfig
    extra_eos_ids: tuple[int, ...]                           # e.g. from generation_config.json
    # (HF checkpoint name, tensor read in part on demand: loaders/lazy.py read_part)
    iter_weights: Callable[[], Iterator[tuple[str, object]]]
    load_tokenizer: Callable[[], object]


def open_model_source(path: str | None, tokenizer_path: str | None = None) -> ModelSource:
    """Resolve `path` (None: the default model) to its config, weights and tokenizer."""
    if path is None:
        from tokenmill.loaders.default_model import default_model_path
        path = default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (expected a Hugging Face model "
                                "directory or a .gguf file; models are not downloaded)")
    if os.path.isfile(path):
        return _gguf_source(path, tokenizer_path)
    return _hf_dir_source(path, tokenizer_path)


def _gguf_source(path: str, tokenizer_path: str | None) -> ModelSource:
    from tokenmill.loaders.gguf import GGUFFile
    gguf_file = GGUFFile(path)
    tok = (lambda: _hf_tokenizer(tokenizer_path)) if tokenizer_path else gguf_file.load_tokenizer
    return ModelSource(path, gguf_file.hf_config(), (), gguf_file.iter_lazy, tok)


def _hf_dir_source(path: str, tokenizer_path: str | None) -> ModelSource:
    from tokenmill.loaders import safetensors_dir as st
    return ModelSource(path, st.load_hf_config(path), st.generation_eos_ids(path),
                       lambda: st.iter_safetensors_lazy(path), lambda: _hf_tokenizer(tokenizer_path or path))


def _hf_tokenizer(path: str):
    from tokenmill.loaders.safetensors_dir import load_tokenizer
    return load_tokenizer(path)
