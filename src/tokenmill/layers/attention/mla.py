"""Multi-head latent attention over a latent cache (DeepSeek-V2/V3), in portable torch ops (CPU and CUDA).

Per token and layer the cache holds one latent [kv_lora_rank] (normalized) and the shared rope key
[qk_rope_head_dim], side by side in latent_cache [1, num_slots, kv_lora_rank + qk_rope_head_dim]. With
kv_b_proj split per head into W_UK [H, nope, rank] and W_UV [H, v, rank]:
  key_h   = [W_UK_h c ; k_pe],  value_h = W_UV_h c
- prefill chunks: keys and values expanded from the context's latents, then causal attention;
- decodes (one new token): the absorbed form, never expanding the context: q_lat_h = W_UK_h^T q_nope_h,
  score = q_lat_h . c + q_pe_h . k_pe, out_h = W_UV_h (sum_l p_l c_l). Same values, far fewer bytes read.
An FP8 latent cache (kv_cache_dtype="fp8"): one byte a value, the latent and the rope key each under its own
float32 scale per layer (fp8_kv.KVScales with one "head": k = the latent's scale, v = the rope key's),
calibrated on the layer's first tokens as the K/V cache's are; read back as float32 times the scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.fp8_kv import KVScales, quantize


class MLABackend:
    name = "base"

    def forward(self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, cache, meta: AttentionMetadata,
                scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, rank] (normalized), k_pe [T, rope]
        (rotated): the new tokens; w_uk [H, nope, rank], w_uv [H, v, rank]; cache [1, slots, rank + rope]
        (float8_e4m3fn with kv_scales). Writes the new tokens' latents at meta.slot_mapping, returns
        [T, H * v]."""
        raise NotImplementedError


def write_latents(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  kv_scales: KVScales | None) -> None:
    """The new tokens' [latent ; k_pe] rows into their cache slots; as FP8 codes under kv_scales if given."""
    if kv_scales is None:
        cache[0].index_copy_(0, slots, torch.cat([latent, k_pe], dim=-1).to(cache.dtype))
        return
    kv_scales.calibrate(latent.unsqueeze(1), k_pe.unsqueeze(1))
    codes = torch.cat([quantize(latent.unsqueeze(1), kv_scales.k), quantize(k_pe.unsqueeze(1), kv_scales.v)], dim=-1)
    cache[0].view(torch.uint8).index_copy_(0, slots, codes[:, 0].view(torch.uint8))   # no float8 index_copy_


def read_latents(cache: torch.Tensor, slots: torch.Tensor, rank: int, kv_scales: KVScales | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents [len(slots), rank], rope keys [len(slots), rope]) of those slots, in `dtype`."""
    rows = cache[0].index_select(0, slots)
    if kv_scales is None:                                      # a bfloat16 cache under float32 compute: widened
        return rows[:, :rank].to(dtype), rows[:, rank:].to(dtype)
    return ((rows[:, :rank].float() * kv_scales.k).to(dtype), (rows[:, rank:].float() * kv_scales.v).to(dtype))


class TorchMLA(MLABackend):
    name = "torch"

    def forward(self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, cache, meta, scale, kv_scales=None):
        write_latents(cache, meta.slot_mapping, latent, k_pe, kv_scales)
        num_tokens, num_heads, _ = q_nope.shape
        out = q_nope.new_empty(num_tokens, num_heads, w_uv.shape[1])
        rank = latent.shape[-1]
        decodes_only = meta.decode_rows is not None and len(meta.seqs) == meta.decode_rows.numel()
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            out[rows] = self._decode(q_nope[rows], q_pe[rows], w_uk, w_uv, cache, meta, scale, rank, kv_scales)
        if not decodes_only:
            for s in meta.seqs:
                if s.query_len > 1 or meta.decode_rows is None:
                    rows = slice(s.query_start, s.query_start + s.query_len)
                    out[rows] = self._prefill(q_nope[rows], q_pe[rows], w_uk, w_uv, cache, s, scale, rank,
                                              kv_scales)
        return out.view(num_tokens, -1)

    @staticmethod
    def _decode(q_nope, q_pe, w_uk, w_uv, cache, meta, scale, rank, kv_scales) -> torch.Tensor:
        """Absorbed: [R, H, *] -> [R, H, v] over meta.decode_slots [R, L] (padded, masked)."""
        num_reqs, max_len = meta.decode_slots.shape
        c, kpe = read_latents(cache, meta.decode_slots.view(-1), rank, kv_scales, q_nope.dtype)
        c, kpe = c.view(num_reqs, max_len, -1), kpe.view(num_reqs, max_len, -1)                 # [R, L, *]
        q_lat = torch.einsum("rhn,hnc->rhc", q_nope, w_uk)                                     # [R, H, rank]
        scores = torch.matmul(q_lat, c.transpose(1, 2)) + torch.matmul(q_pe, kpe.transpose(1, 2))   # [R, H, L]
        probs = (scores.float() * scale + meta.decode_mask).softmax(dim=-1).to(c.dtype)
        o_lat = torch.matmul(probs, c)                                                         # [R, H, rank]
        return torch.einsum("rhc,hvc->rhv", o_lat, w_uv)

    @staticmethod
    def _prefill(q_nope, q_pe, w_uk, w_uv, cache, s, scale, rank, kv_scales) -> torch.Tensor:
        """One request's chunk, keys and values expanded from its context's latents: [n, H, *] -> [n, H, v]."""
        c, kpe = read_latents(cache, s.context_slots.to(cache.device), rank, kv_scales, q_nope.dtype)   # [L, *]
        num_heads = q_nope.shape[1]
        k_nope = torch.einsum("lc,hnc->hln", c, w_uk)                                           # [H, L, nope]
        v = torch.einsum("lc,hvc->hlv", c, w_uv)                                                # [H, L, v]
        k = torch.cat([k_nope, kpe.unsqueeze(0).expand(num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)                                  # [H, n, nope + rope]
        start = s.context_len - s.query_len
        if start == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            q_pos = torch.arange(start, s.context_len, device=q.device).unsqueeze(1)
            mask = torch.arange(s.context_len, device=q.device).unsqueeze(0) <= q_pos            # True = attend
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o.transpose(0, 1)


MLA_BACKENDS = {b.name: b for b in (TorchMLA,)}


def get_mla_backend(name: str) -> MLABackend:
    if name not in MLA_BACKENDS:
        raise ValueError(f"unknown MLA backend {name!r}; expected one of {sorted(MLA_BACKENDS)}")
    return MLA_BACKENDS[name]()
