"""Hugging Face directories: sharded safetensors with the index, generation_config EOS ids, and errors
that name the tensor at fault."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def copy_dir(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_sharded_checkpoint_loads_identically(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    sharded = str(tmp_path / "sharded")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="1MB")
    shutil.copy(os.path.join(tiny_model_dir, "tokenizer.json"), sharded)
    shutil.copy(os.path.join(tiny_model_dir, "tokenizer_config.json"), sharded)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    a = LLM(tiny_model_dir, kv_cache_memory_bytes=1 << 22).generate(["shards"], GREEDY)[0]
    b = LLM(sharded, kv_cache_memory_bytes=1 << 22).generate(["shards"], GREEDY)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_generation_config_eos_ids_are_used(tiny_model_dir, tmp_path):
    d = copy_dir(tiny_model_dir, tmp_path / "m")
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    llm = LLM(d, kv_cache_memory_bytes=1 << 22)
    assert set(llm.engine.eos_token_ids) >= {2, 7}


def _edit_weights(d: str, fn) -> None:
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    d = copy_dir(tiny_model_dir, tmp_path / "m")
    _edit_weights(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors for: model\.layers\.1\.mlp\.gate_up_proj\.weight \[up\]"):
        LLM(d, kv_cache_memory_bytes=1 << 22)


def test_wrong_shape_is_named(tiny_model_dir, tmp_path):
    d = copy_dir(tiny_model_dir, tmp_path / "m")
    _edit_weights(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        LLM(d, kv_cache_memory_bytes=1 << 22)


def test_unexpected_tensor_is_named(tiny_model_dir, tmp_path):
    d = copy_dir(tiny_model_dir, tmp_path / "m")
    _edit_weights(d, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.ones(2)))
    with pytest.raises(ValueError, match=r"unexpected checkpoint tensor 'model\.layers\.0\.mystery\.weight'"):
        LLM(d, kv_cache_memory_bytes=1 << 22)


def test_unsupported_architecture_is_a_clear_error(tiny_model_dir, tmp_path):
    d = copy_dir(tiny_model_dir, tmp_path / "m")
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        LLM(d, kv_cache_memory_bytes=1 << 22)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))
