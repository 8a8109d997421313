"""DeepSeek-V3 (and R1, which uses it): multi-head latent attention over a latent KV cache, MoE MLPs with
sigmoid grouped routing, a correction bias and shared experts (dense MLPs in the first
first_k_dense_replace layers), yarn rope on interleaved pairs.

Tensor parallelism splits attention heads (q_b_proj / kv_b_proj rows, o_proj columns); every rank caches
the whole latent (it is per token, not per head). MoE layers follow layers/moe (split experts, or expert
parallel). The checkpoint's MTP layers, model.layers.{num_hidden_layers + i}, are not part of this
model's graph: the loader passes them over (the speculative-decoding proposer loads them)."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import split_evenly, tensor_parallel
from tokenmill.layers.attention.base import AttentionMetadata, latent_spec
from tokenmill.layers.embedding import gather_logits
from tokenmill.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, yarn_mscale
from tokenmill.models.base import CausalLM
from tokenmill.models.llama import LlamaModel
from tokenmill.models.moe_llama import MoEMixin
from tokenmill.models.weights import load_named_weights

LATENT_NORM_EPS = 1e-6            # q_a_layernorm and kv_a_layernorm (DeepSeek's default, not rms_norm_eps)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class HeadRows(nn.Module):
    """A float matrix [rows, in] read per head, not as a Linear (never quantized): this rank's heads' rows
    of the checkpoint tensor."""

    def __init__(self, rows: tuple[int, int], in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows[1], in_features, dtype=dtype), requires_grad=False)

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        return slice(self.rows[0], self.rows[0] + self.rows[1]), slice(None)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-1/2, times yarn's mscale(factor, mscale_all_dim)^2 where the rope scaling is yarn."""
    scale = cfg.mla.qk_head_dim ** -0.5
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        m, tp = cfg.mla, tensor_parallel()
        if cfg.num_heads < tp.size:
            raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's {cfg.num_heads} attention heads")
        first, self.num_heads = split_evenly(cfg.num_heads, tp.size, tp.rank)
        self.mla = m
        h, qk = cfg.hidden_size, m.qk_head_dim
        latent_out = m.kv_lora_rank + m.qk_rope_head_dim
        bias = cfg.attention_bias         # HF attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj (not q_proj)
        if m.q_lora_rank is not None:     # q_a and kv_a read the same input: one fused projection
            self.fused_qkv_a_proj = MergedLinear(h, {"q_a": m.q_lora_rank, "kv_a": latent_out}, bias=bias,
                                                 dtype=cfg.dtype,
                                                 shard_runs={"q_a": (0, m.q_lora_rank), "kv_a": (0, latent_out)})
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, cfg.dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, cfg.num_heads * qk, dtype=cfg.dtype,
                                                 rows=(first * qk, self.num_heads * qk))
        else:
            self.q_proj = ColumnParallelLinear(h, cfg.num_heads * qk, dtype=cfg.dtype,
                                               rows=(first * qk, self.num_heads * qk))
            self.kv_a_proj_with_mqa = Linear(h, latent_out, bias=bias, dtype=cfg.dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, cfg.dtype)
        per_head = m.qk_nope_head_dim + m.v_head_dim
        self.kv_b_proj = HeadRows((first * per_head, self.num_heads * per_head), m.kv_lora_rank, cfg.dtype)
        # o_proj's bias (attention_out_bias): added by tensor-parallel rank 0 only
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, cfg.hidden_size, bias=cfg.attention_out_bias,
                                        dtype=cfg.dtype, cols=(first * m.v_head_dim, self.num_heads * m.v_head_dim))
        self.rotary = rotary
        self.scale = softmax_scale(cfg)
        self.backend = None                              # an MLA backend, bound by the model runner
        self.latent_cache: torch.Tensor | None = None    # [1, num_slots, kv_lora_rank + qk_rope_head_dim]
        self.kv_scales = None                            # fp8_kv.KVScales (latent, rope key) when the cache is FP8

    def cache_spec(self):
        return latent_spec(self.mla.latent_dim)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj per head: (W_UK [H, nope, rank], W_UV [H, v, rank]), views of its weight."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]

    def forward(self, rope, x: torch.Tensor, meta: AttentionMetadata, keep_rows=None) -> torch.Tensor:
        m = self.mla
        if m.q_lora_rank is not None:
            q_a, kv_a = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(x))
            q = self.q_b_proj(self.q_a_layernorm(q_a.contiguous()))
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q = q.view(-1, self.num_heads, m.qk_head_dim)
        q_nope, q_pe = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:].contiguous()
        latent = self.kv_a_layernorm(kv_a[:, :m.kv_lora_rank].contiguous())
        k_pe = kv_a[:, m.kv_lora_rank:].contiguous().unsqueeze(1)                     # [T, 1, rope]
        q_pe, k_pe = self.rotary(rope, q_pe, k_pe)
        w_uk, w_uv = self.absorbed_weights()
        out = self.backend.forward(q_nope, q_pe, latent, k_pe.squeeze(1), w_uk, w_uv, self.latent_cache, meta,
                                   self.scale, self.kv_scales)
        if keep_rows is not None:
            out = out[keep_rows]
        return self.o_proj(out)


class DeepseekV3ForCausalLM(MoEMixin, CausalLM):
    STACKED = {
        "fused_qkv_a_proj": [("q_a_proj", "q_a"), ("kv_a_proj_with_mqa", "kv_a")],
        "gate_up_proj": [("gate_proj", "gate"), ("up_proj", "up")],
    }
    IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mla is None or cfg.moe is None:
            raise ValueError("DeepseekV3ForCausalLM needs the config's MLA (kv_lora_rank, ...) and MoE fields")
        self.config = cfg
        if cfg.mla.q_lora_rank is None:          # q_proj and kv_a_proj_with_mqa stay separate layers
            self.STACKED = {k: v for k, v in self.STACKED.items() if k != "fused_qkv_a_proj"}
        m = cfg.mla
        rotary = RotaryEmbedding(m.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                 interleaved=m.rope_interleave)
        self.model = LlamaModel(cfg, self.make_mlp, MLAttention, rotary)     # Llama's layer and model graph
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, dtype=cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def greedy_head_linear(self) -> Linear:
        return self.lm_head

    def forward(self, input_ids, positions, meta, keep_rows=None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)

    def is_mtp_tensor(self, name: str) -> bool:
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= self.config.num_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        no_shared = self.config.moe.num_shared_experts == 0      # HF then saves empty shared-expert tensors

        def skipped(n: str) -> bool:
            return n in skip or self.is_mtp_tensor(n) or self.other_ranks_expert(n) or \
                (no_shared and ".shared_experts." in n)
        load_named_weights(self, weights, self.STACKED, self.IGNORED_SUFFIXES, skipped)
