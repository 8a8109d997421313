"""MoE models from GGUF files (llama.cpp's layout): Mixtral as "llama" with expert tensors, Qwen3-MoE as
"qwen3moe"; experts stacked in one tensor per projection [E, rows, cols]. Files written here from tiny
random HF models; the engine's logits equal transformers' on the HF directory within 1e-4, greedy tokens
identical."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams

PROMPT = [11, 220, 4890, 17, 9, 300, 5, 5, 1000, 2000, 3000, 4000]
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "gate": "ffn_gate_inp"}
_EXPERTS = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
            "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (llama / Mixtral q and k rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(model_dir: str, path: str, arch: str) -> None:
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    gguf_arch = "llama" if arch == "mixtral" else "qwen3moe"
    w = gguf.GGUFWriter(path, gguf_arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_name("tiny")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3_moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    stacked: dict[str, list] = {}
    for name, t in state.items():
        data = t.float().numpy()
        if name in _GLOBAL:
            w.add_tensor(_GLOBAL[name], data)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        parts = module.split(".")
        if "experts" in parts:                              # ...experts.{e}.w1 -> stacked later
            key = f"blk.{layer}.{_EXPERTS[parts[-1]]}.{kind}"
            stacked.setdefault(key, [None] * experts)[int(parts[-2])] = data
            continue
        module = module.replace("block_sparse_moe.", "").replace("mlp.", "")
        if arch == "mixtral" and module == "self_attn.q_proj":
            data = _permute(data, heads)
        if arch == "mixtral" and module == "self_attn.k_proj":
            data = _permute(data, kv_heads)
        w.add_tensor(f"blk.{layer}.{_LAYER[module]}.{kind}", data)
    for key, parts in stacked.items():
        w.add_tensor(key, np.stack(parts))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_gguf_matches_transformers(tiny_model_factory, tmp_path, arch):
    from transformers import AutoModelForCausalLM
    model_dir = tiny_model_factory(arch, tie_word_embeddings=False)
    path = str(tmp_path / f"{arch}.gguf")
    write_moe_gguf(model_dir, path, arch)
    llm = LLM(path, tokenizer=model_dir, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    assert llm.engine.config.model.architecture == {"mixtral": "MixtralForCausalLM",
                                                    "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model, n = llm.engine.core.runner.model, len(PROMPT)
    slots = torch.arange(n)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(PROMPT), slots,
                                            AttentionMetadata(slots, [SeqSpan(0, n, n, slots)])))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (logits - ref).abs().max().item() <= 1e-4
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    ids = PROMPT + out.outputs[0].token_ids
    with torch.no_grad():
        full = hf(torch.tensor([ids])).logits[0]
    assert out.outputs[0].token_ids == full[len(PROMPT) - 1:-1].argmax(-1).tolist()
