"""The CPU's fused decode program: one native DecodeLayer per decoder layer (csrc/decode_layer.cpp),
which runs a decode step with the same kernels as the per-op path, minus the Python between them.

Built once, after quantization and KV cache binding, from the model's DenseDecoder (models/base.py). A
step runs here when every row is one request's single new token and there are at most `max_rows` rows:
any number where every linear layer's tiles take every step (int8, int4) or its method names its
large-step kernel (float32: oneDNN), else the tile kernels' limit. `build` returns None (per-op path
only) without the tile kernels, for layers they cannot take (e.g. w8a8), or for a KV cache that is neither
float32 nor FP8 (an FP8 cache is written and read as layers/attention/fp8_kv.py and the CPU backend do)."""
from __future__ import annotations

import torch

from tokenmill.platforms import cpu_native


class NativeDecodeProgram:
    def __init__(self, decoder, native_layers: list, max_rows: int) -> None:
        self.decoder, self.native_layers, self.max_rows = decoder, native_layers, max_rows
        self.steps = 0                        # steps that ran here (observability, tests)

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
            cache_ok = attn.k_cache is not None and (attn.k_cache.dtype == torch.float32 if scales is None
                                                     else attn.k_cache.dtype == torch.float8_e4m3fn)
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
        """Every row one request's single new token, at most max_rows of them."""
        rows = meta.slot_mapping.numel()
        return meta.decode_rows is not None and rows <= self.max_rows and len(meta.seqs) == rows \
            and meta.decode_rows.numel() == rows

    def __call__(self, input_ids, positions, meta, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """What the model's forward returns for this step (see CausalLM.forward); the caller checked takes()."""
        d = self.decoder
        x, residual = d.embed(input_ids), None
        cos, sin = d.rotary.gather(positions)
        step = cpu_native.load().DecodeStep(cos, sin, meta.slot_mapping, meta.decode_slots, meta.decode_lens)
        self.steps += 1
        for native_layer in self.native_layers:
            x, residual = native_layer.forward(x, residual, step)
        if keep_rows is not None:
            x, residual = x[keep_rows], residual[keep_rows]
        x, _ = d.final_norm(x, residual)
        return x
