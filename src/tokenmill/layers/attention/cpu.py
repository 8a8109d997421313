"""Fast CPU paged attention. Single-token queries (decodes): a native kernel that reads keys and values in
place from the paged cache (csrc/cpu_kernels.cpp), or, without a compiler, one batched matmul pair over one
gather of their context. Prefill chunks: a native causal kernel over the paged cache, every chunk of the
step in one call (csrc/prefill_attention.cpp, float32, head dim 64 or 128), else torch's
scaled_dot_product_attention per chunk (causal, reading no cache at all when the chunk starts at 0).
A bfloat16 cache (kv_cache_dtype="bfloat16") is written rounded to nearest even and read in place by the same
kernels, each value widened to float32 exactly (the torch fallback: read, then widened).
An FP8 cache (kv_cache_dtype="fp8") is written quantized (natively: write_kv_cache_fp8); the native kernels
read its codes in place (the decode kernel is the float32 one with codes decoded as rows load), every
key and value of a prefill chunk's context its own new ones included (paged_decode_attention_fp8,
prefill_attention with the scales); the torch fallback reads the context dequantized (fp8_kv.read_slots)
and a chunk starting at 0 its fresh float keys."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.platforms import cpu_native
from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.layers.attention.fp8_kv import read_slots, scale_pair


class CPUAttention(AttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.native = cpu_native.load()

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales=None) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        num_tokens, num_heads, head_dim = q.shape
        if meta.decode_rows is not None and len(meta.seqs) == meta.decode_rows.numel():
            out = self._decode_any(q, k_cache, v_cache, meta, scale, kv_scales)
            return out.reshape(num_tokens, num_heads * head_dim)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode_any(q[meta.decode_rows], k_cache, v_cache, meta, scale, kv_scales)
        prefills = [s for s in meta.seqs if s.query_len > 1 or meta.decode_rows is None]
        if kv_scales is None and self._native_prefill(q, prefills, meta):
            self.native.prefill_attention(q.contiguous(), k_cache, v_cache, meta.prefill_spans, meta.prefill_slots,
                                          scale, out)
        elif kv_scales is not None and self._native_prefill(q, prefills, meta):     # E4M3 codes read in place
            self.native.prefill_attention(q.contiguous(), k_cache.view(torch.uint8), v_cache.view(torch.uint8),
                                          meta.prefill_spans, meta.prefill_slots, scale, out,
                                          k_scale=kv_scales.k, v_scale=kv_scales.v)
        else:
            for s in prefills:
                rows = slice(s.query_start, s.query_start + s.query_len)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, s, scale, kv_scales)
        return out.view(num_tokens, num_heads * head_dim)

    def forward_with_sinks(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, sinks, window,
                           kv_scales=None) -> torch.Tensor:
        """gpt-oss's attention (sinks None: a sliding window alone, Mistral's) in the native kernels, which take
        the sinks and the window (a decode reads only its window's keys; a prefill block gathers only the keys
        its queries' windows reach): float32 or bfloat16 cache, head dim 64 or 128, the step's prefill tables
        listing its chunks. Else the torch ops (sinks.py)."""
        prefills = [s for s in meta.seqs if s.query_len > 1 or meta.decode_rows is None]
        if self.native is None or q.dtype != torch.float32 or kv_scales is not None \
                or not self.native.prefill_attention_supports(q.shape[-1]) \
                or (prefills and not self._native_prefill(q, prefills, meta)):
            return super().forward_with_sinks(q, k, v, k_cache, v_cache, meta, scale, sinks, window, kv_scales)
        self.native.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        sinks, window = None if sinks is None else sinks.float().contiguous(), window or 0
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self.native.paged_decode_attention(
                q[meta.decode_rows].contiguous(), k_cache, v_cache, meta.decode_slots, meta.decode_lens, scale,
                sinks=sinks, window=window)
        if prefills:
            self.native.prefill_attention(q.contiguous(), k_cache, v_cache, meta.prefill_spans, meta.prefill_slots,
                                          scale, out, sinks=sinks, window=window)
        return out.view(num_tokens, num_heads * head_dim)

    def _store(self, k, v, k_cache, v_cache, slot_mapping, kv_scales) -> None:
        """The new keys and values into the cache: natively for float32 ones (into a float32 or bfloat16 cache; an
        FP8 cache's codes bitwise as fp8_kv.quantize rounds them, after the layer's scales are calibrated), else
        AttentionBackend.store."""
        if self.native is None or k.dtype != torch.float32:
            self.store(k, v, k_cache, v_cache, slot_mapping, kv_scales)
        elif kv_scales is None:
            self.native.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        else:
            kv_scales.calibrate(k, v)
            self.native.write_kv_cache_fp8(k, v, k_cache, v_cache, slot_mapping, kv_scales.k, kv_scales.v)

    def _native_prefill(self, q, prefills, meta: AttentionMetadata) -> bool:
        """Whether the native kernel takes this step's prefill chunks: float32 on an AVX-512 build with a head
        dim it has, and the step's prefill tables list exactly these chunks."""
        return bool(prefills) and self.native is not None and q.dtype == torch.float32 \
            and self.native.prefill_attention_supports(q.shape[-1]) and meta.prefill_spans is not None \
            and meta.prefill_spans.shape[0] == len(prefills)

    def _decode_any(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales) -> torch.Tensor:
        if self.native is not None and q.dtype == torch.float32 and kv_scales is None:
            return self.native.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_slots,
                                                      meta.decode_lens, scale)
        if self.native is not None and q.dtype == torch.float32:         # FP8 codes decoded in the kernel
            return self.native.paged_decode_attention_fp8(
                q.contiguous(), k_cache.view(torch.uint8), v_cache.view(torch.uint8), meta.decode_slots,
                meta.decode_lens, scale, kv_scales.k, kv_scales.v)
        return self._decode(q, k_cache, v_cache, meta, scale, kv_scales)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales=None) -> torch.Tensor:
        """q [R, H, D] -> [R, H, D], attending to meta.decode_slots [R, L] (padded, masked)."""
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        max_len = meta.decode_slots.shape[1]
        flat = meta.decode_slots.view(-1)
        k_scale, v_scale = scale_pair(kv_scales)
        keys = read_slots(k_cache, flat, k_scale).to(q.dtype).view(num_kv_heads, num_reqs, max_len, head_dim)
        values = read_slots(v_cache, flat, v_scale).to(q.dtype).view(num_kv_heads, num_reqs, max_len, head_dim)
        qg = q.view(num_reqs, num_kv_heads, group, head_dim).transpose(0, 1)                  # [KV, R, G, D]
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)                         # [KV, R, G, L]
        scores.add_(meta.decode_mask)                                                          # mask [R, 1, L]
        probs = scores.softmax(dim=-1)
        out = torch.matmul(probs, values)                                                      # [KV, R, G, D]
        return out.transpose(0, 1).reshape(num_reqs, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, s, scale: float, kv_scales=None) -> torch.Tensor:
        """One request's chunk: q [n, H, D]; k/v [n, KV, D] (its new tokens) -> [n, H, D]."""
        start = s.context_len - s.query_len
        qh = q.transpose(0, 1).unsqueeze(0)                                                   # [1, H, n, D]
        if start == 0:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)            # [1, KV, n, D]
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        else:  # earlier positions come from the cache (chunked prefill, prefix hit, recompute)
            k_scale, v_scale = scale_pair(kv_scales)
            kh = read_slots(k_cache, s.context_slots, k_scale).to(q.dtype).unsqueeze(0)        # [1, KV, L, D]
            vh = read_slots(v_cache, s.context_slots, v_scale).to(q.dtype).unsqueeze(0)
            q_pos = torch.arange(start, s.context_len).unsqueeze(1)
            mask = torch.arange(s.context_len).unsqueeze(0) <= q_pos                           # [n, L] True = attend
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
