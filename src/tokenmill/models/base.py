"""The interface the model runner uses of a model, and the description of a dense decoder that fused
decode programs (platforms: the CPU's native decoder layers) take instead of probing model internals."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from tokenmill.distributed.parallel_state import split_evenly, tensor_parallel


@dataclass(frozen=True)
class AttentionHeads:
    """This tensor-parallel rank's attention heads: a run of kv heads (an even split) and their groups of
    query heads."""
    first_kv_head: int
    num_kv_heads: int
    first_head: int
    num_heads: int


def attention_heads(cfg) -> AttentionHeads:
    tp = tensor_parallel()
    if cfg.num_kv_heads < tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's {cfg.num_kv_heads} key/value "
                         "heads (each rank holds at least one)")
    group = cfg.num_heads // cfg.num_kv_heads
    first, count = split_evenly(cfg.num_kv_heads, tp.size, tp.rank)
    return AttentionHeads(first, count, first * group, count * group)


@dataclass(frozen=True)
class DenseDecoderLayer:
    """One pre-norm layer: x + attn(input_norm(x)), then + down(silu_and_mul(gate_up(post_norm(.))))."""
    input_norm: nn.Module          # layers/norm.py RMSNorm
    post_norm: nn.Module
    qkv_proj: nn.Module            # layers/linear.py MergedLinear q|k|v
    o_proj: nn.Module
    gate_up_proj: nn.Module        # MergedLinear gate|up
    down_proj: nn.Module
    attention: nn.Module           # has num_heads, num_kv_heads, head_dim, scale, k_cache, v_cache, backend


@dataclass(frozen=True)
class DenseDecoder:
    """Embedding -> layers (GQA attention with rotary positions, SwiGLU MLP) -> final norm."""
    embed: nn.Module               # layers/embedding.py VocabParallelEmbedding (whole in a group of one)
    rotary: nn.Module              # layers/rotary.py RotaryEmbedding (gather(positions) -> cos, sin)
    layers: tuple[DenseDecoderLayer, ...]
    final_norm: nn.Module


class CausalLM(nn.Module):
    """A decoder-only language model as the runner drives it. Built inside platforms.building(...)."""

    # Whether a decode step's forward is free of host syncs and host-built metadata beyond what
    # worker/cuda_graphs.py keeps static (MoE's grouped experts and MLA's latent attention are not).
    supports_cuda_graphs = True

    def attention_layers(self) -> list[nn.Module]:
        """The modules the runner binds a KV cache and a backend to, in layer order: each has cache_spec()
        (layers/attention/base.py KVCacheSpec: the tensors it caches per token, set on it by name) and
        `backend` (an attention backend of the spec's kind)."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] ([len(keep_rows), hidden] when given)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden] -> logits [R, vocab] float32."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name in this model's module names (load_weights renames the same way)."""
        return name

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterable[tuple[str, object]]:
        """The checkpoint's (name, tensor) pairs as this model's loaders take them (gpt-oss splits its fused
        expert tensors per expert); unchanged by default. quant/prequantized.py's passes read through it."""
        return weights

    def greedy_head_linear(self) -> nn.Module | None:
        """The Linear whose logits' argmax is the greedy token (compute_logits adds nothing), or None."""
        return None

    def dense_decoder(self) -> DenseDecoder | None:
        """This model as a DenseDecoder when it is one (fused decode programs then apply), else None."""
        return None

    def finish_loading(self, platform) -> None:
        """Once, after the weights are loaded and quantized: choose kernels that need the final weights
        (MoE models: platforms' moe_kernel)."""

    def other_ranks_expert(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is an expert another expert-parallel rank holds (MoE models)."""
        return False

    def expert_token_counts(self) -> list[int] | None:
        """Tokens routed to each expert, summed over MoE layers since start (load balance); None: dense."""
        return None
