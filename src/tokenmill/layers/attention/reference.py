"""Reference paged attention: one request at a time, explicit causal mask and softmax. Slow, obvious;
the oracle for tests."""
from __future__ import annotations

import torch

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention.fp8_kv import read_slots, scale_pair


class ReferenceAttention(AttentionBackend):
    name = "reference"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales=None) -> torch.Tensor:
        self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        k_scale, v_scale = scale_pair(kv_scales)
        num_tokens, num_heads, head_dim = q.shape
        group = num_heads // k_cache.shape[0]
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
        for s in meta.seqs:
            qs = q[s.query_start:s.query_start + s.query_len]             # [n, H, D]
            ks = read_slots(k_cache, s.context_slots, k_scale).transpose(0, 1).repeat_interleave(group, dim=1)  # [L, H, D]
            vs = read_slots(v_cache, s.context_slots, v_scale).transpose(0, 1).repeat_interleave(group, dim=1)
            scores = torch.einsum("nhd,lhd->hnl", qs.float(), ks.float()) * scale
            q_pos = torch.arange(s.context_len - s.query_len, s.context_len, device=q.device).unsqueeze(1)  # [n, 1]
            k_pos = torch.arange(s.context_len, device=q.device).unsqueeze(0)             # [1, L]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[s.query_start:s.query_start + s.query_len] = torch.einsum("hnl,lhd->nhd", probs, vs.float()).to(q.dtype)
        return out.reshape(num_tokens, num_heads * head_dim)
