"""Paged attention through the Triton kernels (triton_kernels.py): the CUDA path's backend. On a machine
without a GPU it runs under Triton's interpreter (TRITON_INTERPRET=1), slowly: for tests of the path.

Per step: the new keys and values go into the cache, then the single-token queries (decodes) run the
split decode kernel and the multi-token chunks run the prefill kernel, each over the step's block tables
(AttentionMetadata.block_tables); gpt-oss's sinks and sliding windows (forward_with_sinks) in the same
kernels. A step that mixes decodes and chunks builds the kernels' operands (each kind's rows of the block
tables, the chunks' starts and lengths) once, from the metadata already on the device, and every layer
reuses them: no host-to-device copy or host sync per layer."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class MixedStepOperands:
    """What the kernels read in a step of decodes and chunks, the same for every layer."""
    decode_rows: torch.Tensor | None      # [D] int64 rows of the token batch (None: no decodes)
    decode_lens: torch.Tensor | None      # [D] context lengths
    decode_tables: torch.Tensor | None    # [D, most blocks] the decodes' block tables
    prefill_starts: torch.Tensor | None   # [P] first row of each chunk (None: no chunks)
    prefill_lens: torch.Tensor | None     # [P] new tokens of each chunk
    prefill_contexts: torch.Tensor | None # [P] context length of each chunk (its new tokens included)
    prefill_tables: torch.Tensor | None   # [P, most blocks]
    max_query_len: int = 0                # the longest chunk


def mixed_step_operands(meta: AttentionMetadata, device: torch.device) -> MixedStepOperands:
    """The step's operands on `device`: device tensors of the metadata where it has them (decode_rows,
    decode_lens, prefill_spans, block_tables, moved with the step's inputs), gathered by one index copied
    once; built from the host's spans where it has not (metadata made by hand)."""
    decodes = [i for i, s in enumerate(meta.seqs) if s.query_len == 1]
    prefills = [i for i, s in enumerate(meta.seqs) if s.query_len > 1]
    index = torch.tensor(decodes + prefills, dtype=torch.long).to(device, non_blocking=True)  # one small copy a step
    tables = meta.block_tables.to(device)
    ops = MixedStepOperands(None, None, None, None, None, None, None)
    if decodes:
        d = len(decodes)
        ops.decode_tables = tables.index_select(0, index[:d])
        if meta.decode_rows is not None and meta.decode_lens is not None and meta.decode_rows.numel() == d:
            ops.decode_rows, ops.decode_lens = meta.decode_rows.to(device), meta.decode_lens.to(device)
        else:
            host = torch.tensor([[meta.seqs[i].query_start, meta.seqs[i].context_len] for i in decodes],
                                dtype=torch.long).t().contiguous().to(device)
            ops.decode_rows, ops.decode_lens = host[0], host[1]
    if prefills:
        ops.prefill_tables = tables.index_select(0, index[len(decodes):])
        spans = meta.prefill_spans
        if spans is None or spans.shape[0] != len(prefills):
            spans = torch.tensor([[meta.seqs[i].query_start, meta.seqs[i].query_len, meta.seqs[i].context_len]
                                  for i in prefills], dtype=torch.long)
        columns = spans.to(device).t().contiguous()                                # [3, P]: each row contiguous
        ops.prefill_starts, ops.prefill_lens, ops.prefill_contexts = columns[0], columns[1], columns[2]
        ops.max_query_len = max(meta.seqs[i].query_len for i in prefills)
    return ops


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from tokenmill.layers.attention import triton_kernels   # imports triton: only when chosen
        self.kernels = triton_kernels
        self._step_meta = None            # weakref to the metadata _step_ops were built for
        self._step_ops: MixedStepOperands | None = None

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
        ops = self.step_operands(meta, q.device)
        out = torch.empty_like(q)
        if ops.decode_rows is not None:
            out[ops.decode_rows] = self.kernels.paged_decode_attention(
                q[ops.decode_rows].contiguous(), k_cache, v_cache, ops.decode_tables, ops.decode_lens,
                meta.block_size, scale, kv_scales=kv_scales, **extra)
        if ops.prefill_starts is not None:
            self.kernels.paged_prefill_attention(                # the chunks' rows of out, in place
                q, k_cache, v_cache, ops.prefill_tables, ops.prefill_starts, ops.prefill_lens, ops.prefill_contexts,
                meta.block_size, scale, ops.max_query_len, out=out, kv_scales=kv_scales, **extra)
        return out.view(num_tokens, num_heads * head_dim)

    def step_operands(self, meta: AttentionMetadata, device: torch.device) -> MixedStepOperands:
        """mixed_step_operands of this step's metadata: built by the first layer, reused by the rest."""
        if self._step_meta is None or self._step_meta() is not meta or self._step_ops is None:
            self._step_ops = mixed_step_operands(meta, device)
            self._step_meta = weakref.ref(meta)
        return self._step_ops
