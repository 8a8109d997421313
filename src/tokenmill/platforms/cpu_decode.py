"""The CPU's fused decode program: one native DecodeLayer per decoder layer (csrc/decode_layer.cpp),
which runs a decode step with the same kernels as the per-op path, minus the Python between them.

Built once, after quantization and KV cache binding, from the model's DenseDecoder (models/base.py). A
step runs here when every request brings at most `max_query_len` new tokens after a context already in the
cache (decodes, and speculative verify steps of 1 + k tokens) and there are at most `max_rows` rows: any
number where every linear layer's tiles take every step (int8, int4) or its method names its large-step
kernel (float32: oneDNN), else the tile kernels' limit.

A request's j-th new token (0-based) of q, after c - q context tokens, is one decode row attending to the
first c - q + j + 1 slots of its table: every row's cache write comes before the layer's attention, so the
rows of one request see exactly the causal prefix the per-op path's prefill kernel gives them. Such rows
re-read their request's context one after another (the prefill kernel reads it once per query block);
measured, n-gram verify steps of 5 rows a request still run 1.17-1.30x faster here than per-op from 4 to 64
requests (int4, default model), and batch-1 decode with n-gram 2.04x against 1.40x no speculation.
"""
from __future__ import annotations

import torch

from tokenmill.platforms import cpu_native


class NativeDecodeProgram:
    max_query_len = 17        # a request's new tokens in a step run here: a decode, or a verify of up to 16
                              # drafts (SpeculativeConfig's most); a longer chunk is a prefill

    def __init__(self, decoder, native_layers: list, max_rows: int) -> None:
        self.decoder, self.native_layers, self.max_rows = decoder, native_layers, max_rows
        self.steps = 0                        # steps that ran here (observability, tests)
        self.verify_steps = 0                 # of them, steps with a request of more than one new token

    @classmethod
    def build(cls, decoder) -> "NativeDecodeProgram | None":
        from tokenmill.quant import tile_kernels
        native = tile_kernels.kernels()
        if native is None:
            return None
        built = []
        for layer in decoder.layers:
            attn = layer.attention
            scales = getattr(attn, "kv_scales", None)          # an FP8 cache's (fp8_kv.KVScales), else None
            cache_ok = attn.k_cache is not None and (attn.k_cache.dtype in (torch.float32, torch.bfloat16)
                                                     if scales is None else attn.k_cache.dtype == torch.float8_e4m3fn)
            if not cache_ok or attn.backend is None or attn.backend.name != "cpu":
                return None
            linears = [m.native_decode_linear(native) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                                 layer.down_proj)]
            if any(lin is None for lin in linears):
                return None
            norms = (layer.input_norm.weight.data, layer.post_norm.weight.data)
            built.append(native.DecodeLayer(*norms, layer.input_norm.eps, *linears, attn.num_heads,
                                            attn.num_kv_heads, attn.head_dim, attn.scale, attn.k_cache,
                                            attn.v_cache, *((scales.k, scales.v) if scales is not None else ())))
        return cls(decoder, built, min(layer.max_rows() for layer in built))

    def takes(self, meta) -> bool:
        """At most max_rows rows, each request's 1..max_query_len new tokens after a cached context (a
        request's first chunk is a prefill: it also calibrates an FP8 cache's scales)."""
        rows = meta.slot_mapping.numel()
        if rows > self.max_rows:
            return False
        if len(meta.seqs) == rows:
            return meta.decode_rows is not None and meta.decode_rows.numel() == rows
        return all(
            s.query_len <= self.max_query_len and s.context_len > s.query_len for s in meta.seqs)

    @staticmethod
    def row_tables(meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode_slots [T, L] int64, decode_lens [T] int64): each row's context slots (padded with slot 0,
        never read) and length, the j-th of a request's q new tokens after c - q cached ones seeing c - q + j + 1."""
        if meta.decode_rows is not None and meta.decode_rows.numel() == len(meta.seqs) == meta.slot_mapping.numel():
            return meta.decode_slots, meta.decode_lens
        lens = torch.cat([torch.arange(s.context_len - s.query_len + 1, s.context_len + 1) for s in meta.seqs])
        table = torch.nn.utils.rnn.pad_sequence([s.context_slots for s in meta.seqs], batch_first=True)
        owner = torch.repeat_interleave(torch.tensor([s.query_len for s in meta.seqs]))   # [T]: request of row
        return table.index_select(0, owner), lens

    def __call__(self, input_ids, positions, meta, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """What the model's forward returns for this step (see CausalLM.forward); the caller checked takes()."""
        d = self.decoder
        x, residual = d.embed(input_ids), None
        cos, sin = d.rotary.gather(positions)
        slots, lens = self.row_tables(meta)
        step = cpu_native.load().DecodeStep(cos, sin, meta.slot_mapping, slots, lens)
        self.steps += 1
        self.verify_steps += len(meta.seqs) != meta.slot_mapping.numel()
        for native_layer in self.native_layers:
            x, residual = native_layer.forward(x, residual, step)
        if keep_rows is not None:
            x, residual = x[keep_rows], residual[keep_rows]
        x, _ = d.final_norm(x, residual)
        return x
