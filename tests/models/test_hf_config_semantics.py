"""ModelConfig.from_hf reads the fields transformers' modeling code acts on as it acts on them: which layers
slide and over how many tokens, which projections carry biases, the gated MLPs' activation; an activation
tokenmill does not compute is refused by name (tests/models/test_parity.py and test_moe_models.py check the
logits of each against transformers)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import transformers

from tokenmill import LLM
from tokenmill.config import ModelConfig

SMALL = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("config,windows", [
    (transformers.MistralConfig(**SMALL), (4096,) * 3),                      # Mistral's default window
    (transformers.MistralConfig(**SMALL, sliding_window=None), ()),
    (transformers.MixtralConfig(**SMALL, sliding_window=7), (7,) * 3),
    (transformers.MixtralConfig(**SMALL), ()),
    (transformers.Qwen2Config(**SMALL, sliding_window=64), ()),               # use_sliding_window False
    (transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=1),
     (None, 64, 64)),
    (transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=3), ()),
    (transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=64,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
     (64, None, 64)),
    (transformers.Qwen3MoeConfig(**SMALL, use_sliding_window=True, sliding_window=8), (8,) * 3),
    (transformers.Qwen3MoeConfig(**SMALL, sliding_window=8), ()),
    (transformers.GptOssConfig(**SMALL, sliding_window=4), (4, None, 4)),     # layer_types' default
    (transformers.LlamaConfig(**SMALL), ()),
])
def test_sliding_windows_are_the_layers_transformers_masks(config, windows):
    cfg = ModelConfig.from_hf(config)
    assert cfg.layer_windows == windows
    assert [cfg.window(i) for i in range(3)] == list(windows or (None,) * 3)


@pytest.mark.parametrize("config,qkv,out,mlp", [
    (transformers.LlamaConfig(**SMALL, attention_bias=True), True, True, False),
    (transformers.LlamaConfig(**SMALL, mlp_bias=True), False, False, True),
    (transformers.Qwen2Config(**SMALL), True, False, False),                  # q/k/v only, always
    (transformers.Qwen3MoeConfig(**SMALL, attention_bias=True), True, True, False),
    (transformers.GptOssConfig(**SMALL), True, True, False),                  # attention_bias defaults to True
    (transformers.GptOssConfig(**SMALL, attention_bias=False), False, False, False),
    (transformers.MistralConfig(**SMALL), False, False, False),
])
def test_biases_are_the_projections_transformers_biases(config, qkv, out, mlp):
    cfg = ModelConfig.from_hf(config)
    assert (cfg.attention_bias, cfg.attention_out_bias, cfg.mlp_bias) == (qkv, out, mlp)


def test_hidden_act_reaches_the_dense_mlps_and_the_experts():
    assert ModelConfig.from_hf(transformers.LlamaConfig(**SMALL, hidden_act="gelu")).hidden_act == "gelu"
    moe = ModelConfig.from_hf(transformers.MixtralConfig(**SMALL, hidden_act="gelu_pytorch_tanh"))
    assert moe.hidden_act == moe.moe.activation == "gelu_pytorch_tanh"
    gpt_oss = ModelConfig.from_hf(transformers.GptOssConfig(**SMALL))         # its own clamped SwiGLU
    assert gpt_oss.moe.activation == "clamped_swiglu"


@pytest.mark.parametrize("config", [transformers.LlamaConfig(**SMALL, hidden_act="relu"),
                                    transformers.MixtralConfig(**SMALL, hidden_act="quick_gelu")])
def test_an_unsupported_hidden_act_is_refused_by_name(config):
    with pytest.raises(ValueError, match=rf"hidden_act '{config.hidden_act}' is not supported; supported: silu, "
                                         "swish, gelu, gelu_pytorch_tanh"):
        ModelConfig.from_hf(config)


def test_loading_a_model_with_an_unsupported_hidden_act_names_it(tiny_model_factory, tmp_path):
    out = str(tmp_path / "relu")
    shutil.copytree(tiny_model_factory("llama"), out)
    path = os.path.join(out, "config.json")
    json.dump({**json.load(open(path)), "hidden_act": "relu"}, open(path, "w"))
    with pytest.raises(ValueError, match="model config hidden_act 'relu' is not supported"):
        LLM(out, kv_cache_memory_bytes=1 << 22)
