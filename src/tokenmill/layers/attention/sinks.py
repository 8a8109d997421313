"""Attention with sinks and a sliding window (gpt-oss; a window alone for Mistral, Mixtral, Qwen2 and
Qwen3-MoE: sinks None), over the paged cache the backend wrote:

    p = softmax([q.k_j * scale for j in window] + [sink_h])      the sink takes a share and gives no value
    out = sum_j p_j v_j                                          j: positions q_pos - window < j <= q_pos

Here in torch ops, on any device: decodes batched over the step's padded decode slots, prefill chunks per
request in blocks of query rows (bounding the [heads, rows, context] scores); exact, and the reference the
kernels are tested against. It is AttentionBackend.forward_with_sinks's default; the CPU backend runs its
native kernels instead where they take the layer (cpu.py), the Triton backend its kernels. The fused decode
programs know neither sinks nor windows."""
from __future__ import annotations

import torch

from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.fp8_kv import read_slots, scale_pair

QUERY_BLOCK = 256           # prefill query rows per score matrix


def sink_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   scale: float, sinks: torch.Tensor | None, window: int | None, kv_scales=None) -> torch.Tensor:
    """q [T, H, D] (rotated; the step's keys and values already in the cache), sinks [H] or None (no sink
    logit) -> [T, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    k_scale, v_scale = scale_pair(kv_scales)
    sinks = None if sinks is None else sinks.float()
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode(q[meta.decode_rows].float(), k_cache, v_cache, meta, scale, sinks,
                                        window, k_scale, v_scale)
    for s in meta.seqs:
        if meta.decode_rows is not None and s.query_len == 1:
            continue                                            # a decode: done above
        keys = read_slots(k_cache, s.context_slots, k_scale).float()         # [KV, L, D]
        values = read_slots(v_cache, s.context_slots, v_scale).float()
        first = s.context_len - s.query_len                     # the chunk's first position
        for r0 in range(0, s.query_len, QUERY_BLOCK):
            r1 = min(r0 + QUERY_BLOCK, s.query_len)
            rows = slice(s.query_start + r0, s.query_start + r1)
            q_pos = torch.arange(first + r0, first + r1, device=q.device)
            out[rows] = _attend(q[rows].float().transpose(0, 1), keys, values, q_pos, scale, sinks,
                                window).transpose(0, 1)
    return out.to(q.dtype).reshape(num_tokens, num_heads * head_dim)


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., n, L] True where a query at q_pos [..., n] may read the key at k_pos [L]: causal, in the window."""
    ahead = q_pos.unsqueeze(-1) - k_pos                           # >= 0: the key is not in the future
    keep = ahead >= 0
    return keep if window is None else keep & (ahead < window)


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """scores [..., H, n, L] (masked with -inf), sinks [H] -> probabilities [..., H, n, L] with the sink's
    share left out; sinks None: the plain softmax."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
            sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """q [H, n, D]; keys/values [KV, L, D] (positions 0..L-1) -> [H, n, D]."""
    group = q.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0)                      # [H, L, D]
    v = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale           # [H, n, L]
    keep = _allowed(q_pos, torch.arange(k.shape[1], device=q.device), window)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(_with_sinks(scores, sinks), v)


def _decode(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None,
            window: int | None, k_scale, v_scale) -> torch.Tensor:
    """q [R, H, D], one new token per request, over meta.decode_slots [R, L] (padded) -> [R, H, D]."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[0]
    group, max_len = num_heads // num_kv, meta.decode_slots.shape[1]
    flat = meta.decode_slots.reshape(-1)
    keys = read_slots(k_cache, flat, k_scale).float().view(num_kv, num_reqs, max_len, head_dim)
    values = read_slots(v_cache, flat, v_scale).float().view(num_kv, num_reqs, max_len, head_dim)
    qg = q.view(num_reqs, num_kv, group, head_dim).transpose(0, 1)                 # [KV, R, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale                      # [KV, R, G, L]
    q_pos = (meta.decode_lens - 1).view(num_reqs, 1)                               # [R, 1]
    keep = _allowed(q_pos, torch.arange(max_len, device=q.device), window)         # [R, 1, L] (padding: future)
    scores = scores.masked_fill(~keep.unsqueeze(0), float("-inf"))
    probs = _with_sinks(scores.transpose(0, 1).reshape(num_reqs, num_heads, 1, max_len), sinks)   # [R, H, 1, L]
    probs = probs.view(num_reqs, num_kv, group, max_len).transpose(0, 1)          # [KV, R, G, L]
    return torch.matmul(probs, values).transpose(0, 1).reshape(num_reqs, num_heads, head_dim)
