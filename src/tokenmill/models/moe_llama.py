"""Llama-family decoders whose MLPs are mixtures of experts: Mixtral (every layer MoE, softmax top-k,
renormalized) and Qwen3-MoE (q/k RMSNorm per head; MoE on the layers config.decoder_sparse_step and
mlp_only_layers choose, top-k renormalized when norm_topk_prob). Attention is LlamaAttention's.

Checkpoint names: Mixtral's `block_sparse_moe.{gate, experts.{e}.w1|w2|w3}` (w1 gate, w3 up, w2 down),
Qwen3-MoE's `mlp.{gate, experts.{e}.gate_proj|up_proj|down_proj}`; both land in layers/moe's
SparseMoeBlock as `mlp.gate`, `mlp.experts.{e}.gate_up_proj|down_proj`."""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import expert_parallel, split_evenly
from tokenmill.layers.moe import SparseMoeBlock, expert_token_counts, moe_blocks
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP
from tokenmill.models.weights import load_named_weights

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class MoEMixin:
    """What an MoE CausalLM adds: MoE MLPs on config.moe.sparse_layers, expert-parallel loading (a rank
    reads only its experts), kernels chosen by the platform after loading, expert token counts."""
    supports_cuda_graphs = False          # the grouped experts sync with the host to size their runs

    @staticmethod
    def make_mlp(cfg: ModelConfig, layer_index: int) -> nn.Module:
        if layer_index in cfg.moe.sparse_layers:
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.dtype)
        return LlamaMLP(cfg)

    def other_ranks_expert(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to an expert another expert-parallel rank holds."""
        m = _EXPERT.search(name)
        if m is None:
            return False
        ep = expert_parallel()                      # every MoE layer splits its experts the same way
        first, count = split_evenly(self.config.moe.num_experts, ep.size, ep.rank)
        return not first <= int(m.group(1)) < first + count

    def finish_loading(self, platform) -> None:
        for moe in moe_blocks(self):
            moe.set_kernel(platform.moe_kernel(moe))

    def expert_token_counts(self) -> list[int] | None:
        return expert_token_counts(self)


class MixtralForCausalLM(MoEMixin, LlamaForCausalLM):
    STACKED = {**LlamaForCausalLM.STACKED, "gate_up_proj": [("w1", "gate"), ("w3", "up")]}

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.").replace(".w2.", ".down_proj.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = ((self.checkpoint_name(name), t) for name, t in weights)
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        load_named_weights(self, renamed, self.STACKED, self.IGNORED_SUFFIXES,
                           lambda n: n in skip or self.other_ranks_expert(n))


class Qwen3MoeForCausalLM(MoEMixin, LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        load_named_weights(self, weights, self.STACKED, self.IGNORED_SUFFIXES,
                           lambda n: n in skip or self.other_ranks_expert(n))
