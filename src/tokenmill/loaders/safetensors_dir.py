"""A Hugging Face model directory: config.json, one or sharded *.safetensors (with the index),
tokenizer files with the chat template, generation_config.json."""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files, from the index when there is one; an error names what is missing."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r} (expected model.safetensors, "
                                f"or shards listed in {INDEX_FILE})")
    paths = [os.path.join(model_dir, f) for f in files]
    for p in paths:
        if not os.path.exists(p):
            raise FileNotFoundError(f"weight shard {p!r} named in {INDEX_FILE} does not exist")
    return paths


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of every shard."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_safetensors_lazy(model_dir: str):
    """(checkpoint name, loaders/lazy.py SafetensorsSlice) for every tensor: read in part on demand,
    each before the next is yielded."""
    from tokenmill.loaders.lazy import SafetensorsSlice
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, SafetensorsSlice(f, name)


def load_hf_config(model_dir: str):
    from transformers import AutoConfig
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir!r} has no config.json: expected a Hugging Face model directory "
                                "or a .gguf file")
    return AutoConfig.from_pretrained(model_dir)


def generation_eos_ids(model_dir: str) -> tuple[int, ...]:
    """EOS ids from generation_config.json (often more than config.json lists, e.g. Llama 3's eot)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
