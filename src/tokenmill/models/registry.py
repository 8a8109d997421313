"""Architecture name (the HF config's `architectures[0]`) -> model class, imported lazily."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("tokenmill.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenmill.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("tokenmill.models.llama", "Qwen2ForCausalLM"),
    "MixtralForCausalLM": ("tokenmill.models.moe_llama", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenmill.models.moe_llama", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("tokenmill.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("tokenmill.models.gpt_oss", "GptOssForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; tokenmill supports "
                         f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
