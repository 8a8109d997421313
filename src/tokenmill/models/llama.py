"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2/2.5, SmolLM2): pre-norm decoder, GQA, RoPE, a gated MLP
(SwiGLU, or GELU where the config's hidden_act says so). Biases as transformers builds them: q/k/v with
attention_bias (Qwen2 always), o_proj with ModelConfig.attention_out_bias, the MLP with Llama's mlp_bias.
Sliding windows (Mistral, Mixtral, Qwen2, Qwen3-MoE: ModelConfig.layer_windows) are each attention layer's
`window`, run by the backend's forward_with_sinks without sinks.

Checkpoint names follow Hugging Face; fused weights declare which checkpoint tensors fill them as data
(`STACKED`), so any loader that yields (hf_name, tensor) works.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.layers.attention import AttentionBackend, AttentionMetadata
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.attention.base import KVCacheSpec, kv_heads_spec
from tokenmill.layers.embedding import VocabParallelEmbedding, gather_logits
from tokenmill.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.base import CausalLM, DenseDecoder, DenseDecoderLayer, attention_heads
from tokenmill.models.weights import load_named_weights


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        heads = attention_heads(cfg)                   # this tensor-parallel rank's run of kv heads
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        q_run, kv_run = (heads.first_head * d, heads.num_heads * d), (heads.first_kv_head * d, heads.num_kv_heads * d)
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size},
                                     bias=cfg.attention_bias, dtype=cfg.dtype,
                                     shard_runs={"q": q_run, "k": kv_run, "v": kv_run})
        # o_proj's bias: added by tensor-parallel rank 0 only (RowParallelLinear.adds_bias)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_out_bias, dtype=cfg.dtype,
                                        cols=q_run)
        if cfg.qk_norm:                                # Qwen3: RMSNorm over each head's head_dim
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5
        self.backend: AttentionBackend | None = None   # bound by the model runner
        self.k_cache: torch.Tensor | None = None       # [num_kv_heads, num_slots, head_dim]
        self.v_cache: torch.Tensor | None = None
        self.kv_scales = None                          # fp8_kv.KVScales when the cache is FP8 (bound with it)
        # tokens a query attends back to, its own included (positions p - window + 1 .. p); None: all. Set by
        # the model from ModelConfig.window(layer index). The cache still holds every position (prefix hits
        # and chunked prefill read it as for full attention); only the attention is limited.
        self.window: int | None = None

    def cache_spec(self) -> KVCacheSpec:
        return kv_heads_spec(self.num_kv_heads, self.head_dim)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                meta: AttentionMetadata, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """rope: the step's (cos, sin) from RotaryEmbedding.gather; x [T, hidden] -> [T, hidden], or
        [len(keep_rows), hidden] for rows keep_rows only (every row's keys and values are still cached)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = self.rotary(rope, q, k)
        out = self.attend(q, k, v, meta)
        if keep_rows is not None:
            out = out[keep_rows]
        return self.o_proj(out)


    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Cache the new keys and values, then attend: q [T, H, D], k/v [T, KV, D] -> [T, H * D] (within the
        layer's window where it has one: the backends' windowed kernels, no sinks)."""
        if self.window is None:
            return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return self.backend.forward_with_sinks(q, k, v, self.k_cache, self.v_cache, meta, self.scale, None,
                                               self.window, self.kv_scales)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size                   # MoE models' dense layers too
        bias = cfg.mlp_bias                            # down_proj's added by tensor-parallel rank 0 only
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=bias, dtype=cfg.dtype)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=bias, dtype=cfg.dtype)
        self.act_and_mul = gated_activation(cfg.hidden_act)       # [T, 2I] -> act(gate) * up [T, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))      # via [T, 2 * intermediate]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module, attention: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention                     # LlamaAttention, or DeepSeek's MLAttention
        self.mlp = mlp                                 # LlamaMLP, or an MoE block (models/mixtral.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, rope, x, residual, meta, keep_rows: torch.Tensor | None = None):
        """x, residual [T, hidden] (residual None in the first layer) -> (mlp output, residual), [T, hidden],
        or [len(keep_rows), hidden] after attention when keep_rows is given (the last layer of a step whose
        other rows are not sampled: their attention output, o_proj and MLP are skipped)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, make_mlp, make_attention=LlamaAttention,
                 rotary: RotaryEmbedding | None = None) -> None:
        """make_mlp(cfg, layer index) -> the layer's MLP; make_attention(cfg, rotary) -> its attention;
        rotary: the positions' embedding (default: over head_dim, as Llama)."""
        super().__init__()
        self.make_attention = make_attention
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype)
        self.rotary = rotary or RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                                cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary, make_mlp(cfg, i), make_attention(cfg, self.rotary))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids, positions, meta, keep_rows: torch.Tensor | None = None,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden], or of rows keep_rows only
        ([len(keep_rows), hidden]; the last layer then skips the other rows after caching their keys and
        values: in a prefill chunk only the last row is sampled). num_layers: through the first layers only,
        then the final norm (a layer-truncated self-draft, spec/draft_model.py)."""
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.gather(positions)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            x, residual = layer(rope, x, residual, meta, keep_rows if i == last else None)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    # fused parameter <- (checkpoint name part, shard id)
    STACKED = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", "gate"), ("up_proj", "up")],
    }
    IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
    attention_class = LlamaAttention           # make_attention(cfg, rotary) of every layer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.make_mlp, self.attention_class)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, dtype=cfg.dtype)   # vocab runs
        if cfg.tie_word_embeddings:   # one tensor, two uses; loaded as model.embed_tokens.weight
            self.lm_head.weight = self.model.embed_tokens.weight
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.window = cfg.window(i)

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer_index: int) -> nn.Module:
        return LlamaMLP(cfg)

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def greedy_head_linear(self) -> Linear:
        return self.lm_head

    def dense_decoder(self) -> DenseDecoder | None:
        """None where the native decoder layers would compute something else: q/k norms, MoE MLPs, a gated
        activation other than SiLU, sliding windows (they attend to the whole context)."""
        m = self.model
        if self.config.qk_norm or not all(isinstance(layer.mlp, LlamaMLP) for layer in m.layers):
            return None
        if self.config.hidden_act not in ("silu", "swish") or any(w is not None for w in self.config.layer_windows):
            return None
        layers = tuple(DenseDecoderLayer(layer.input_layernorm, layer.post_attention_layernorm,
                                         layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                         layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.self_attn)
                       for layer in m.layers)
        return DenseDecoder(m.embed_tokens, m.rotary, layers, m.norm)

    def forward(self, input_ids, positions, meta, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (rows keep_rows only when given)."""
        return self.model(input_ids, positions, meta, keep_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] float32."""
        return gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        load_named_weights(self, weights, self.STACKED, self.IGNORED_SUFFIXES, skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same graph; q/k/v carry a bias (ModelConfig.attention_bias is True for Qwen2, attention_out_bias False);
    with use_sliding_window, the layers from max_window_layers on slide."""


class MistralForCausalLM(LlamaForCausalLM):
    """Same graph as Llama; every layer slides over sliding_window tokens when the config sets it."""
