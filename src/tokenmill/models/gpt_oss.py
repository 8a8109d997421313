"""gpt-oss (OpenAI's open-weight MoE): Llama's pre-norm decoder with
- attention: biases on q, k, v and o (attention_bias, as in the released models); a learned sink logit per
  head in every softmax; sliding windows of `sliding_window` tokens on the layers `layer_types` names, full
  attention on the others (the backend's forward_with_sinks: the native CPU or the Triton kernels, else
  torch ops, layers/attention/sinks.py); YaRN;
- every MLP a mixture of experts: router logits with a bias, softmax over the top-k; experts with biases and
  the clamped SwiGLU (layers/moe/experts.py clamped_swiglu).

Checkpoint tensors (Hugging Face names) hold all of a layer's experts in one tensor each, which this class
splits into per-expert tensors as they are read (`checkpoint_tensors`), each read only when asked for:
- float: `mlp.experts.gate_up_proj` [E, hidden, 2I] with gate and up interleaved along the last dim
  (gate = [..., 0::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, hidden],
  `down_proj_bias` [E, hidden];
- MXFP4 (quant_method "mxfp4"): `gate_up_proj_blocks` [E, 2I, hidden / 32, 16] uint8 (E2M1 codes two a
  byte, the even element in the low nibble) and `gate_up_proj_scales` [E, 2I, hidden / 32] (E8M0 exponents),
  rows interleaved as above; `down_proj_blocks` / `down_proj_scales` likewise [E, hidden, I / 32, ...]. They
  become compressed-tensors-style `experts.{e}.{gate,up,down}_proj.weight_packed` / `.weight_scale`, which
  quant/prequantized.py takes as they are (the MXFP4 method keeps the file's codes).
`mlp.router` is the MoE block's `mlp.gate`. Tensor parallel splits heads (their sinks too) and experts
as for the other models; the row-parallel biases (o_proj, experts' down_proj) are added by one rank.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.loaders.lazy import read_part
from tokenmill.models.base import attention_heads
from tokenmill.models.llama import LlamaAttention, LlamaForCausalLM
from tokenmill.models.moe_llama import MoEMixin
from tokenmill.models.weights import load_named_weights

_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)"
                            r"(?P<kind>|_bias|_blocks|_scales)$")


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, rotary) -> None:
        super().__init__(cfg, rotary)                # q/k/v and o biases from cfg (attention_bias)
        self.first_head = attention_heads(cfg).first_head
        # this rank's heads' sink logits [num_heads] (of the checkpoint's [num_attention_heads])
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=cfg.dtype), requires_grad=False)

    def checkpoint_slice(self, shard_id) -> tuple[slice, slice]:
        """The rows of `sinks` (this module's one own parameter) that this rank's heads take."""
        return slice(self.first_head, self.first_head + self.num_heads), slice(None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        return self.backend.forward_with_sinks(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sinks,
                                               self.window, self.kv_scales)


class GptOssForCausalLM(MoEMixin, LlamaForCausalLM):
    attention_class = GptOssAttention          # its window set per layer by LlamaForCausalLM

    def dense_decoder(self):
        return None                          # sinks and windows: the fused decode programs know neither

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, object]]) -> Iterable[tuple[str, object]]:
        """The checkpoint's (name, tensor) pairs with each fused expert tensor split into per-expert ones
        (lazy: a piece is read when asked for)."""
        for name, tensor in weights:
            m = _FUSED_EXPERTS.match(name)
            if m is None:
                yield name, tensor
                continue
            yield from _split_experts(m["prefix"], m["name"], m["kind"], tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        renamed = ((self.checkpoint_name(n), t) for n, t in self.checkpoint_tensors(weights))
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        load_named_weights(self, renamed, self.STACKED, self.IGNORED_SUFFIXES,
                           lambda n: n in skip or self.other_ranks_expert(n))


def _split_experts(prefix: str, name: str, kind: str, tensor):
    """One fused expert tensor -> (per-expert checkpoint name, ExpertPart) pairs, gate/up de-interleaved."""
    experts = tensor.shape[0]
    suffix = {"": ".weight", "_bias": ".bias", "_blocks": ".weight_packed", "_scales": ".weight_scale"}[kind]
    # float weights are [E, in, out] (x @ W): transposed to [out, in]; biases [E, out]; MXFP4 [E, out, in...]
    transpose = kind == ""
    parts = (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))) if name == "gate_up_proj" \
        else (("down_proj", slice(None)),)
    for e in range(experts):
        for part, rows in parts:
            yield f"{prefix}.{e}.{part}{suffix}", ExpertPart(tensor, e, rows, transpose, kind == "_blocks")


class ExpertPart:
    """Expert `expert`'s piece of a fused checkpoint tensor, read on demand as a 2-D (or 1-D) tensor
    [out rows, in] of the rows `rows` (gate: every other row from 0, up: from 1): transposed from the float
    layout [in, out], or MXFP4 blocks [out, in / 32, 16] flattened to bytes [out, in / 2]."""

    def __init__(self, source, expert: int, rows: slice, transpose: bool, flatten_blocks: bool) -> None:
        self.source, self.expert, self.rows = source, expert, rows
        self.transpose, self.flatten_blocks = transpose, flatten_blocks
        full = tuple(source.shape[1:])
        if transpose:
            full = (full[1], full[0])
        if flatten_blocks:
            full = (full[0], full[1] * full[2])
        out = len(range(*rows.indices(full[0])))
        self.shape = (out, *full[1:])

    def read(self, rows: slice, cols: slice) -> torch.Tensor:
        piece = read_part(self.source, slice(self.expert, self.expert + 1), slice(None))[0]
        if self.transpose:
            piece = piece.t()
        if self.flatten_blocks:
            piece = piece.reshape(piece.shape[0], -1)
        piece = piece[self.rows].contiguous()
        return read_part(piece, rows, cols)
