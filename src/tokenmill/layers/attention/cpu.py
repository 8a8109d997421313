"""Fast CPU paged attention: all single-token queries in one batched, padded matmul pair; prefill chunks
through torch's scaled_dot_product_attention (causal, no cache read at all when the chunk starts at 0)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata


class CPUAttention(AttentionBackend):
    name = "cpu"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_cache, v_cache, meta, scale)
        for s in meta.seqs:
            if s.query_len > 1 or meta.decode_rows is None:
                rows = slice(s.query_start, s.query_start + s.query_len)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, s, scale)
        return out.view(num_tokens, num_heads * head_dim)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [R, H, D] -> [R, H, D], attending to meta.decode_slots (padded, masked)."""
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        keys = k_cache[meta.decode_slots].permute(0, 2, 3, 1)             # [R, KV, D, L]
        values = v_cache[meta.decode_slots].transpose(1, 2)               # [R, KV, L, D]
        qg = q.view(num_reqs, num_kv_heads, group, head_dim)              # [R, KV, G, D]
        scores = torch.matmul(qg, keys).mul_(scale).add_(meta.decode_mask)  # [R, KV, G, L]
        probs = scores.softmax(dim=-1)
        return torch.matmul(probs, values).view(num_reqs, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, s, scale: float) -> torch.Tensor:
        """One request's chunk: q [n, H, D]; k/v [n, KV, D] (its new tokens) -> [n, H, D]."""
        start = s.context_len - s.query_len
        if start > 0:  # earlier positions come from the cache (chunked prefill, prefix hit, recompute)
            k, v = k_cache[s.context_slots], v_cache[s.context_slots]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, len, D]
        if start == 0:
            o = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(start, s.context_len).unsqueeze(1)
            mask = torch.arange(s.context_len).unsqueeze(0) <= q_pos       # [n, L] True = attend
            o = F.scaled_dot_product_attention(qh.unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
