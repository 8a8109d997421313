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


def _layer_tensors(w: gguf.GGUFWriter, state: dict):
    """Writes the global tensors; yields (layer, name within the layer, float32 array) for the rest."""
    for name, t in state.items():
        data = t.float().numpy()
        if name in _GLOBAL:
            w.add_tensor(_GLOBAL[name], data)
        else:
            _, _, layer, rest = name.split(".", 3)
            yield layer, rest, data


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    for layer, rest, data in _layer_tensors(w, state):
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
    _finish(w)


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


# DeepSeek-V3 as llama.cpp's converter writes it (architecture "deepseek2"): MLA as MQA of one latent head,
# kv_b_proj split per head into attn_k_b (transposed) and attn_v_b, or whole as attn_kv_b in older files
_DS_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
             "self_attn.q_b_proj": "attn_q_b", "self_attn.q_proj": "attn_q",
             "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
             "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output", "mlp.gate": "ffn_gate_inp",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
             "mlp.shared_experts.down_proj": "ffn_down_shexp"}
DS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def write_deepseek_gguf(cfg: dict, state: dict, path: str, split_kv_b: bool) -> None:
    w = gguf.GGUFWriter(path, "deepseek2")
    heads, rank, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(nope + rope)
    w.add_value_length_mla(v_dim)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_rope_dimension_count(rope)
    yarn = cfg["rope_parameters"]
    if yarn["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn["factor"])
        w.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
    stacked: dict[str, list] = {}
    experts = cfg["n_routed_experts"]
    for layer, rest, data in _layer_tensors(w, state):
        if rest == "mlp.gate.e_score_correction_bias":
            w.add_tensor(f"blk.{layer}.exp_probs_b.bias", data)
            continue
        module, kind = rest.rsplit(".", 1)
        parts = module.split(".")
        if "experts" in parts and "shared_experts" not in parts:
            key = f"blk.{layer}.{_EXPERTS[parts[-1]]}.{kind}"
            stacked.setdefault(key, [None] * experts)[int(parts[-2])] = data
        elif module == "self_attn.kv_b_proj" and split_kv_b:      # the converter's absorption split
            kv_b = data.reshape(heads, nope + v_dim, rank)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
        else:
            w.add_tensor(f"blk.{layer}.{_DS_LAYER[module]}.{kind}", data)
    for key, parts in stacked.items():
        w.add_tensor(key, np.stack(parts))
    _finish(w)


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_deepseek_v3_gguf_matches_transformers(tiny_model_factory, tmp_path, split_kv_b):
    """deepseek2 GGUF (yarn rope, grouped sigmoid routing with a nonzero correction bias, shared experts, a
    dense first layer): config and weights recovered, logits equal transformers' within 1e-4."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    model_dir = tiny_model_factory("deepseek_v3", tie_word_embeddings=False, rope_parameters=DS_YARN,
                                   num_nextn_predict_layers=0)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    biased = str(tmp_path / "hf")                    # the router bias is zeros at init: make it matter
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(3)
    for name in list(state):
        if name.endswith("e_score_correction_bias"):
            state[name] = torch.randn_like(state[name]) * 0.5
    hf.load_state_dict(state, strict=False)
    hf.save_pretrained(biased)
    cfg = json.load(open(os.path.join(biased, "config.json")))
    path = str(tmp_path / "ds.gguf")
    write_deepseek_gguf(cfg, state, path, split_kv_b)

    from tokenmill.loaders.gguf import GGUFFile
    config = GGUFFile(path).hf_config()
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace",
                "routed_scaling_factor", "norm_topk_prob", "num_key_value_heads"):
        assert getattr(config, key) == cfg[key], key
    assert config.rope_parameters["mscale_all_dim"] == pytest.approx(0.707)

    llm = LLM(path, tokenizer=model_dir, kv_cache_memory_bytes=1 << 22, enable_prefix_caching=False)
    assert llm.engine.config.model.architecture == "DeepseekV3ForCausalLM"
    from tokenmill.layers.attention import AttentionMetadata, SeqSpan
    model, n = llm.engine.core.runner.model, len(PROMPT)
    slots = torch.arange(n)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(PROMPT), slots,
                                            AttentionMetadata(slots, [SeqSpan(0, n, n, slots)])))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert (logits - ref).abs().max().item() <= 1e-4
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    with torch.no_grad():
        full = hf(torch.tensor([PROMPT + out.outputs[0].token_ids])).logits[0]
    assert out.outputs[0].token_ids == full[len(PROMPT) - 1:-1].argmax(-1).tolist()


def test_deepseek_v2_gguf_is_rejected_by_name(tmp_path):
    from tokenmill.loaders.gguf import GGUFError, GGUFFile
    path = str(tmp_path / "v2.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    _finish(w)
    with pytest.raises(GGUFError, match="DeepSeek-V2"):
        GGUFFile(path).hf_config()


def test_a_deepseek2_gguf_without_a_gating_function_is_taken_for_v2(tmp_path):
    """DeepSeek-V2 / V2.5 files converted before llama.cpp's V3 support have no expert_gating_func, which
    llama.cpp reads as softmax (V2): refused as V2, not run as V3 with sigmoid routing."""
    from tokenmill.loaders.gguf import GGUFError, GGUFFile
    path = str(tmp_path / "v2-no-key.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    _finish(w)
    with pytest.raises(GGUFError, match=r"deepseek2 file with no deepseek2\.expert_gating_func \(softmax, as "
                                        r"llama\.cpp reads it: DeepSeek-V2 / V2\.5\); only DeepSeek-V3 / R1"):
        GGUFFile(path).hf_config()
