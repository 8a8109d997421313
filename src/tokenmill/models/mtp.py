"""Multi-token prediction layers (DeepSeek-V3's layout), the `mtp` proposer's model:

    h'_p = block(eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)]))      logits = lm_head(shared_head.norm(h'_p))

h_p is the target's final hidden state at position p (after its final norm) and t_{p+1} the token after it,
so h'_p predicts t_{p+2}. The block is a decoder layer of the target's own kind (DeepSeek: MLA and MoE;
Llama family: GQA and SwiGLU) with its own KV cache. The embedding and the head are the target's (shared).
Chained for more drafts by feeding h' back with the draft it predicted (TensorRT-LLM's "MTP Eagle").

Checkpoint names are DeepSeek's, relative to the layer: enorm, hnorm, eh_proj, shared_head.norm, and the
block's input_layernorm, self_attn.*, post_attention_layernorm, mlp.* (DeepSeek's model.layers.{N + i}.*;
`tokenmill train-mtp` writes the same names).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.llama import LlamaDecoderLayer

# checkpoint tensors of an MTP layer that are the target's own (shared here, not loaded twice)
SHARED_WITH_TARGET = ("embed_tokens.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype)


class MTPLayer(LlamaDecoderLayer):
    def __init__(self, cfg, rotary, mlp: nn.Module, attention: nn.Module) -> None:
        super().__init__(cfg, rotary, mlp, attention)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, cfg.dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, cfg.dtype)
        self.eh_proj = Linear(2 * h, h, dtype=cfg.dtype)          # whole on every tensor-parallel rank
        self.shared_head = SharedHead(h, cfg.rms_norm_eps, cfg.dtype)

    def predict(self, embed: nn.Module, rope, ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, meta) -> torch.Tensor:
        """ids [T] (t_{p+1}), positions [T] (p), prev_hidden [T, hidden] (h_p) -> h'_p [T, hidden]. The
        embedding of position 0 is zeroed, as DeepSeek's reference does."""
        e = embed(ids)
        e = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(e), e)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(prev_hidden)], dim=-1))
        out, residual = self(rope, x, None, meta)
        return out + residual


def build_mtp_layer(target) -> MTPLayer:
    """An MTP layer of the target's kind: its attention class, its last layer's kind of MLP (DeepSeek's MTP
    layers are MoE like its last layers), its rotary embedding. `target` is built on LlamaModel."""
    cfg, model = target.config, target.model
    return MTPLayer(cfg, model.rotary, target.make_mlp(cfg, cfg.num_layers - 1),
                    model.make_attention(cfg, model.rotary))
