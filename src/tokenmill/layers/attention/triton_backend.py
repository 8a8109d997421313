"""Paged attention through the Triton kernels (triton_kernels.py): the CUDA path's backend. On a machine
without a GPU it runs under Triton's interpreter (TRITON_INTERPRET=1), slowly: for tests of the path.

Per step: the new keys and values go into the cache, then the single-token queries (decodes) run the
split decode kernel and the multi-token chunks run the prefill kernel, each over the step's block tables
(AttentionMetadata.block_tables); gpt-oss's sinks and sliding windows (forward_with_sinks) in the same
kernels."""
from __future__ import annotations

import torch

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from tokenmill.layers.attention import triton_kernels   # imports triton: only when chosen
        self.kernels = triton_kernels

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, kv_scales=None) -> torch.Tensor:
        return self.forward_with_sinks(q, k, v, k_cache, v_cache, meta, scale, None, None, kv_scales)

    def forward_with_sinks(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, sinks, window,
                           kv_scales=None) -> torch.Tensor:
        """Both kernels take the sinks (None: none) and the window (None: all)."""
        extra = {"sinks": sinks, "window": window}
        if meta.block_tables is None:
            raise ValueError("the triton attention backend needs the step's block tables in its metadata")
        self.store(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        num_tokens, num_heads, head_dim = q.shape
        if meta.decode_rows is not None and meta.decode_rows.numel() == num_tokens and meta.decode_lens is not None:
            # decodes only, row i = sequence i: device tensors alone, no host work (CUDA graphs capture this)
            out = self.kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.block_tables,
                                                      meta.decode_lens, meta.block_size, scale, kv_scales=kv_scales,
                                                      **extra)
            return out.view(num_tokens, num_heads * head_dim)
        out = torch.empty_like(q)
        decodes = [i for i, s in enumerate(meta.seqs) if s.query_len == 1]
        prefills = [i for i, s in enumerate(meta.seqs) if s.query_len > 1]
        if decodes:
            self._decode(q, k_cache, v_cache, meta, scale, decodes, out, kv_scales, extra)
        if prefills:
            self._prefill(q, k_cache, v_cache, meta, scale, prefills, out, kv_scales, extra)
        return out.view(num_tokens, num_heads * head_dim)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, idx: list[int], out,
                kv_scales, extra) -> None:
        seqs = [meta.seqs[i] for i in idx]
        rows = torch.tensor([s.query_start for s in seqs], dtype=torch.long, device=q.device)
        lens = torch.tensor([s.context_len for s in seqs], dtype=torch.int32, device=q.device)
        tables = meta.block_tables[torch.tensor(idx, dtype=torch.long)].to(q.device)
        out[rows] = self.kernels.paged_decode_attention(q[rows].contiguous(), k_cache, v_cache, tables, lens,
                                                        meta.block_size, scale, kv_scales=kv_scales, **extra)

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, idx: list[int], out,
                 kv_scales, extra) -> None:
        seqs = [meta.seqs[i] for i in idx]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32, device=q.device)  # noqa: E731
        tables = meta.block_tables[torch.tensor(idx, dtype=torch.long)].to(q.device)
        self.kernels.paged_prefill_attention(
            q, k_cache, v_cache, tables, as_tensor([s.query_start for s in seqs]),
            as_tensor([s.query_len for s in seqs]), as_tensor([s.context_len for s in seqs]), meta.block_size,
            scale, max(s.query_len for s in seqs), out=out, kv_scales=kv_scales, **extra)   # the chunks' rows of out, in place
