"""What every attention backend gets for one step, and the interface it implements.

KV cache layout, per layer: k_cache, v_cache [num_kv_heads, num_slots, head_dim] (head-major, so one
gather along dim 1 yields per-head [len, head_dim] matrices ready for matmul) with
num_slots = num_blocks * block_size; the token at position p of a request lives in slot
block_ids[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer caches per token, as named tensors [heads, num_slots, width] that the model
    runner allocates and sets on the layer under those names. Every layer shares the block table, so the
    block manager needs only the sum of their bytes per token."""
    kind: str                                    # "attention" (K/V per kv head) | "mla" (one latent)
    tensors: tuple[tuple[str, int, int], ...]    # (attribute name, heads, width)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return sum(heads * width for _, heads, width in self.tensors) * dtype.itemsize

    def shapes(self, num_slots: int) -> list[tuple[str, tuple[int, int, int]]]:
        return [(name, (heads, num_slots, width)) for name, heads, width in self.tensors]


def kv_heads_spec(num_kv_heads: int, head_dim: int) -> KVCacheSpec:
    """Grouped-query attention: k_cache and v_cache [num_kv_heads, num_slots, head_dim]."""
    return KVCacheSpec("attention", (("k_cache", num_kv_heads, head_dim), ("v_cache", num_kv_heads, head_dim)))


def latent_spec(latent_dim: int) -> KVCacheSpec:
    """Multi-head latent attention: latent_cache [1, num_slots, kv_lora_rank + qk_rope_head_dim]."""
    return KVCacheSpec("mla", (("latent_cache", 1, latent_dim),))


@dataclass
class SeqSpan:
    """One request's part of the step's flattened token batch."""
    query_start: int             # first row of its new tokens in the [num_tokens, ...] batch
    query_len: int               # new tokens this step
    context_len: int             # tokens whose KV it attends to, new ones included (= start position + query_len)
    context_slots: torch.Tensor  # [context_len] int64 cache slots of positions 0..context_len-1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor           # [num_tokens] int64: cache slot of each new token
    seqs: list[SeqSpan]                  # every scheduled request, in batch order
    # single-token queries (decodes), batched for the fast path; None when there are none
    decode_rows: torch.Tensor | None = None    # [num_decodes] int64 rows in the token batch
    decode_slots: torch.Tensor | None = None   # [num_decodes, max_context] int64, padded with slot 0
    decode_mask: torch.Tensor | None = None    # [num_decodes, 1, max_context] float32: 0, or -inf for padding
    decode_lens: torch.Tensor | None = None    # [num_decodes] int64 context lengths
    # multi-token queries (prefill chunks), batched for native kernels; None when there are none
    prefill_spans: torch.Tensor | None = None  # [P, 3] int64: query_start, query_len, context_len of each
    prefill_slots: torch.Tensor | None = None  # [P, max_context] int64 context slots (any valid slot past a context)
    # the block tables themselves, for kernels that page through blocks (Triton); 0 / None when not built
    block_size: int = 0
    block_tables: torch.Tensor | None = None   # [num_seqs, most blocks] int64, batch order, padded with block 0


class AttentionBackend:
    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_scales=None) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] (new tokens, already rotated).
        Writes k/v into the cache at meta.slot_mapping, then returns [T, num_heads * head_dim].
        kv_scales: fp8_kv.KVScales when the caches are float8 (kv_cache_dtype="fp8"), else None."""
        raise NotImplementedError

    def forward_with_sinks(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                           sinks: torch.Tensor | None, window: int | None, kv_scales=None) -> torch.Tensor:
        """forward for gpt-oss's attention: sinks [num_heads] (a logit per head in every softmax, giving no
        value; None: no sinks, a sliding window alone as Mistral's) and a sliding window (a query at p reads
        p - window + 1 .. p; None: all). By default layers/attention/sinks.py's torch ops; the CPU and Triton
        backends run their kernels."""
        from tokenmill.layers.attention.sinks import sink_attention
        self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return sink_attention(q, k_cache, v_cache, meta, scale, sinks, window, kv_scales)

    def store(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None) -> None:
        """write_cache, or its FP8 form (quantized by the layer's scales) when kv_scales is given."""
        if kv_scales is None:
            self.write_cache(k, v, k_cache, v_cache, slot_mapping)
        else:
            from tokenmill.layers.attention.fp8_kv import write_fp8_cache
            write_fp8_cache(k, v, k_cache, v_cache, slot_mapping, kv_scales)

    @staticmethod
    def write_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
        """k, v [T, num_kv_heads, head_dim] -> their slots of the [num_kv_heads, num_slots, head_dim] caches, in
        the caches' dtype (a bfloat16 cache: rounded to nearest even)."""
        k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
