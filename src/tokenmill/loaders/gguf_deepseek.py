"""DeepSeek-V3 / R1 GGUF files (llama.cpp architecture "deepseek2"): config and the kv_b_proj merge.

llama.cpp's converter writes DeepSeek's MLA as multi-query attention with one "head" of
kv_lora_rank + rope dims (`head_count_kv` 1, `key_length` kv_lora_rank + rope, `value_length`
kv_lora_rank); the per-head dims are `key_length_mla` (nope + rope) and `value_length_mla` (v). It
splits HF's kv_b_proj [H * (nope + v), kv_lora_rank] per head into

    attn_k_b  [H, kv_lora_rank, nope]   (W_UK, transposed)
    attn_v_b  [H, v, kv_lora_rank]      (W_UV)

(older files keep one attn_kv_b). `merge_kv_b` puts them back. The MTP layers are not converted. Rope is
on interleaved pairs (the converter does not permute q/k rows). The file has yarn's mscale_all_dim (as
0.1 x `rope.scaling.yarn_log_multiplier`) but not mscale: it is taken as equal, as in DeepSeek-V3 and R1
(both 1.0), which is what llama.cpp computes with.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.loaders.gguf_header import GGUFError, GGUFHeader

_SIGMOID_GATING, _SOFTMAX_GATING = 2, 1   # gguf.ExpertGatingFuncType


def deepseek2_config_kwargs(header: GGUFHeader) -> dict[str, Any]:
    """DeepseekV3Config keyword arguments from a "deepseek2" file's metadata (token ids and tying aside)."""
    meta, path = header.metadata, header.path

    def get(key: str, default: Any = ...) -> Any:
        full = f"deepseek2.{key}"
        if full not in meta:
            if default is ...:
                raise GGUFError(f"{path}: GGUF metadata key {full!r} is missing (needed for DeepSeek-V3).")
            return default
        return meta[full]

    # llama.cpp reads a missing key as softmax: DeepSeek-V2 / V2.5 files converted before V3 support lack it
    gating = get("expert_gating_func", None)
    if gating is None or int(gating) != _SIGMOID_GATING:
        found = "no deepseek2.expert_gating_func (softmax, as llama.cpp reads it: DeepSeek-V2 / V2.5)" \
            if gating is None else f"expert gating function {int(gating)} (softmax: DeepSeek-V2)"
        raise GGUFError(f"{path}: deepseek2 file with {found}; only DeepSeek-V3 / R1 (sigmoid gating, "
                        "deepseek2.expert_gating_func = 2) is supported.")
    if "deepseek2.nextn_predict_layers" in meta and int(meta["deepseek2.nextn_predict_layers"]):
        raise GGUFError(f"{path}: MTP layers inside a GGUF file are not supported; load them from safetensors.")
    heads = int(get("attention.head_count"))
    rope = int(get("rope.dimension_count"))
    qk_head = int(get("attention.key_length_mla"))
    experts = int(get("expert_count"))
    q_lora = get("attention.q_lora_rank", None)
    embedding = header.tensors.get("token_embd.weight")
    return {
        "vocab_size": int(get("vocab_size", embedding.shape[0] if embedding is not None else ...)),
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,                     # the file's 1 is MLA written as MQA
        "kv_lora_rank": int(get("attention.kv_lora_rank")),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk_head - rope,
        "v_head_dim": int(get("attention.value_length_mla")),
        "head_dim": rope,                                 # HF DeepseekV3Config: head_dim = qk_rope_head_dim
        "rope_interleave": True,
        "n_routed_experts": experts,
        "num_experts_per_tok": int(get("expert_used_count")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "n_group": int(get("expert_group_count", 1)),
        "topk_group": int(get("expert_group_used_count", 1)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_parameters": _rope_parameters(get),
        "attention_bias": False,
    }


def _rope_parameters(get) -> dict[str, Any]:
    theta = float(get("rope.freq_base", 10000.0))
    kind = get("rope.scaling.type", "none")
    if kind in ("none", ""):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise GGUFError(f"deepseek2 rope scaling type {kind!r} is not supported (none, yarn).")
    mscale_all_dim = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(get("rope.scaling.factor")),
              "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
              "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
              "mscale": mscale_all_dim, "mscale_all_dim": mscale_all_dim}
    original = get("rope.scaling.original_context_length", None)
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    return params


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """attn_k_b [H, rank, nope] and attn_v_b [H, v, rank] -> HF kv_b_proj.weight [H * (nope + v), rank]:
    each head's nope rows (W_UK) then its v rows (W_UV)."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise GGUFError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not fit together "
                        "(expected [H, kv_lora_rank, nope] and [H, v, kv_lora_rank]).")
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()
