"""Hugging Face config from GGUF metadata (llama.cpp key names) for llama, mistral, qwen2, mixtral,
qwen3moe and deepseek2 (the last in gguf_deepseek.py).

llama.cpp's converter writes `{arch}.embedding_length`, `{arch}.attention.head_count`, ... and the
tokenizer's special ids under `tokenizer.ggml.*`. Llama 3 rope scaling is not in the metadata: the
converter bakes it into a `rope_freqs.weight` tensor of per-frequency divisors, which
`llama3_rope_parameters` turns back into a `rope_parameters` dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import DeepseekV3Config, LlamaConfig, MistralConfig, MixtralConfig, PretrainedConfig, Qwen2Config, Qwen3MoeConfig

from tokenmill.loaders.gguf_deepseek import deepseek2_config_kwargs
from tokenmill.loaders.gguf_header import GGUFError, GGUFHeader

# GGUF general.architecture -> (HF config class, HF architecture name)
SUPPORTED_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "mistral": (MistralConfig, "MistralForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "mixtral": (MixtralConfig, "MixtralForCausalLM"),     # llama.cpp writes Mixtral as "llama" with experts
    "qwen3moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    "deepseek2": (DeepseekV3Config, "DeepseekV3ForCausalLM"),  # V3 / R1 only: see gguf_deepseek.py
}
# Llama 3.1 / 3.2 rope scaling constants, tried first when recovering llama3 parameters
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192
_ROPE_FREQS_RTOL = 1e-5


def architecture_of(header: GGUFHeader) -> str:
    """The GGUF architecture name, with llama.cpp's "llama"-typed Mistral files reported as "mistral"."""
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{header.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    if arch == "llama" and int(header.metadata.get("llama.expert_count", 0) or 0) > 0:
        return "mixtral"  # llama.cpp converts Mixtral with the llama architecture and expert tensors
    if arch == "llama" and "mistral" in str(header.metadata.get("general.name", "")).lower():
        return "mistral"  # llama.cpp converts Mistral models with the llama architecture
    return arch


def build_hf_config(header: GGUFHeader, rope_freqs: torch.Tensor | None) -> PretrainedConfig:
    """rope_freqs: the dequantized `rope_freqs.weight` tensor [head_dim // 2], or None if absent."""
    arch = architecture_of(header)
    config_cls, hf_arch = SUPPORTED_ARCHITECTURES[arch]
    kwargs = deepseek2_config_kwargs(header) if arch == "deepseek2" else _model_shape_kwargs(header)
    kwargs.update(_token_id_kwargs(header.metadata))
    if arch != "deepseek2":
        kwargs["rope_parameters"] = _rope_parameters(header, kwargs, rope_freqs)
    kwargs["tie_word_embeddings"] = "output.weight" not in header.tensors
    kwargs["attention_bias"] = "blk.0.attn_q.bias" in header.tensors  # Qwen2 always has q/k/v bias
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None  # llama.cpp runs these files with full attention
    kwargs.update(_moe_kwargs(header, arch))
    return config_cls(architectures=[hf_arch], **kwargs)


def _moe_kwargs(header: GGUFHeader, arch: str) -> dict[str, Any]:
    """Experts per layer and per token, and (Qwen3-MoE) the experts' width; llama.cpp runs every layer of
    these files as MoE and renormalizes the chosen experts' weights."""
    meta, gguf_arch = header.metadata, header.metadata["general.architecture"]
    if arch not in ("mixtral", "qwen3moe"):
        return {}
    count, used = int(meta[f"{gguf_arch}.expert_count"]), int(meta[f"{gguf_arch}.expert_used_count"])
    if arch == "mixtral":
        return {"num_local_experts": count, "num_experts_per_tok": used}
    width = int(meta.get(f"{gguf_arch}.expert_feed_forward_length", 0) or 0)
    if not width:
        raise GGUFError(f"{header.path}: GGUF metadata key '{gguf_arch}.expert_feed_forward_length' is missing.")
    return {"num_experts": count, "num_experts_per_tok": used, "moe_intermediate_size": width,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _model_shape_kwargs(header: GGUFHeader) -> dict[str, Any]:
    meta = header.metadata
    gguf_arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        full_key = f"{gguf_arch}.{key}"
        if full_key not in meta and default is None:
            raise GGUFError(f"{header.path}: GGUF metadata key {full_key!r} is missing.")
        return meta.get(full_key, default)

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{header.path}: partial rotary embedding (rope dims {rope_dim} != head_dim {head_dim}) is not supported.")
    return {
        "vocab_size": int(get("vocab_size", _embedding_rows(header))),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length", 0) or get("expert_feed_forward_length", 0) or 0) or
                             _missing(header, f"{gguf_arch}.feed_forward_length"),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
    }


def _missing(header: GGUFHeader, key: str):
    raise GGUFError(f"{header.path}: GGUF metadata key {key!r} is missing.")


def _embedding_rows(header: GGUFHeader) -> int:
    if "token_embd.weight" not in header.tensors:
        raise GGUFError(f"{header.path}: no vocab_size in the metadata and no token_embd.weight tensor.")
    return header.tensors["token_embd.weight"].shape[0]


def _token_id_kwargs(meta: dict[str, Any]) -> dict[str, int]:
    names = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    return {hf: int(meta[f"tokenizer.ggml.{g}"]) for hf, g in names.items() if f"tokenizer.ggml.{g}" in meta}


def _rope_parameters(header: GGUFHeader, shape: dict[str, Any], rope_freqs: torch.Tensor | None) -> dict[str, Any]:
    meta = header.metadata
    prefix = f"{meta['general.architecture']}.rope"
    theta = float(meta.get(f"{prefix}.freq_base", 10000.0))
    scaling_type = meta.get(f"{prefix}.scaling.type", "none")
    original_ctx = meta.get(f"{prefix}.scaling.original_context_length")
    if rope_freqs is not None:
        params = llama3_rope_parameters(rope_freqs, theta, shape["head_dim"], original_ctx)
        return params or {"rope_type": "default", "rope_theta": theta}
    if scaling_type in ("none", ""):
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(meta[f"{prefix}.scaling.factor"])
    if scaling_type == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if scaling_type == "yarn":
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": factor}
        if original_ctx is not None:
            params["original_max_position_embeddings"] = int(original_ctx)
        return params
    raise GGUFError(f"{header.path}: rope scaling type {scaling_type!r} is not supported (none, linear, yarn, llama3).")


def llama3_rope_factors(theta: float, head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-frequency divisors [head_dim // 2] (float64) that the llama3 formula applies to 1/theta^(2i/d)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_ctx = params["original_max_position_embeddings"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen < old_ctx / high, torch.ones_like(divisors), divisors)
    return torch.where(wavelen > old_ctx / low, torch.full_like(divisors, factor), divisors)


def llama3_rope_parameters(
    rope_freqs: torch.Tensor, theta: float, head_dim: int, original_ctx: int | None = None
) -> dict[str, Any] | None:
    """Recover HF llama3 `rope_parameters` from llama.cpp's rope_freqs tensor; None if all ones.

    Only factor, old_ctx/(high-low) and low/(high-low) are identifiable from the divisors, and they
    fix every frequency; so old_ctx defaults to Llama 3's 8192 and the low/high factors follow from it.
    """
    divisors = rope_freqs.to(torch.float64).reshape(-1)
    if divisors.numel() != head_dim // 2:
        raise GGUFError(f"rope_freqs.weight has {divisors.numel()} values, expected head_dim // 2 = {head_dim // 2}.")
    factor = float(divisors.max())
    if torch.allclose(divisors, torch.ones_like(divisors), rtol=_ROPE_FREQS_RTOL):
        return None
    old_ctx = int(original_ctx or _LLAMA3_ORIGINAL_CONTEXT)
    candidates = [(_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR), _fit_low_high(divisors, factor, theta, head_dim, old_ctx)]
    for low_high in candidates:
        if low_high is None:
            continue
        params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                  "low_freq_factor": low_high[0], "high_freq_factor": low_high[1],
                  "original_max_position_embeddings": old_ctx}
        if torch.allclose(llama3_rope_factors(theta, head_dim, params), divisors, rtol=_ROPE_FREQS_RTOL):
            return params
    raise GGUFError("rope_freqs.weight does not match the llama3 rope scaling formula; cannot build rope_parameters.")


def _fit_low_high(divisors: torch.Tensor, factor: float, theta: float, head_dim: int, old_ctx: int) -> tuple[float, float] | None:
    """Least-squares (low, high) from the smoothly interpolated frequencies; None if fewer than two."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    in_between = ((divisors - 1).abs() > 1e-4) & ((divisors - factor).abs() > 1e-4 * factor)
    if int(in_between.sum()) < 2:
        return None
    smooth = (1 / divisors[in_between] - 1 / factor) / (1 - 1 / factor)
    # old_ctx / wavelen = smooth * (high - low) + low: linear in (high - low, low)
    a = torch.stack([smooth, torch.ones_like(smooth)], dim=1)
    spread, low = torch.linalg.lstsq(a, (old_ctx / wavelen[in_between]).unsqueeze(1)).solution.reshape(-1).tolist()
    return round(low, 6), round(low + spread, 6)
