"""The interface every linear-layer quantization method implements.

A method object is stateless and shared by all layers that use it; what it computes lives on the layer
(packed weights, scales) as buffers. Life cycle of one `Linear`:
    create_weights(layer)                  at construction: the float32 `weight` [out, in] checkpoints load into
    process_weights_after_loading(layer)   once, after loading: pack `weight` for the kernel, drop it
    apply(layer, x)                        every forward: x [T, in] float32 -> [T, out] float32
    tile_weights(layer)                    once, after packing: (kind, tiles, scales) of the native tile
                                           kernel gemv_<kind> its steps of at most `tile_max_rows` rows run,
                                           or None; tile_kernel(layer) binds it
    large_kernel(layer)                    once, after packing: what `apply` runs, named for the native
                                           decoder layer (csrc/decode_layer.h LargeLinear), or None
    prefill_kernel(layer)                  once, after packing: what a step's prefill rows run when it has
                                           at least `prefill_min_rows` of them (layers/linear.py), or None
    take_input_quant(layer, input_quant)   once, for a pre-quantized checkpoint that quantizes activations
"""
from __future__ import annotations

import torch
from torch import nn


class QuantMethod:
    name = "base"
    platform = "cpu"               # where its kernels run (quant/__init__.py registers it there)
    is_float = False               # the checkpoint's float weights (no quantization)
    direct_gguf_types: tuple[str, ...] = ()   # GGUF block types set_packed takes as they are (gguf_direct.py)
    # Quantize an lm_head that shares its weight with the input embedding (a separate packed copy; the
    # embedding itself stays float32). Worth it when the head's bytes dominate a decode step.
    quantize_tied_lm_head = True
    # Method name for the lm_head instead of this one (None: this one). The head turns hidden states into
    # logits directly, so it is the layer most sensitive to weight error (llama.cpp keeps it at >= 6 bits).
    lm_head_method: str | None = None
    # Steps of at most this many rows run tile_kernel's function (where there is one), larger ones `apply`.
    tile_max_rows: int = 0
    # A step with at least this many prefill rows (prompt chunks) runs them through prefill_kernel's
    # function where there is one: measured, int4 / int8 tiles widened to bfloat16 for oneDNN's GEMM on AMX
    # overtake the VNNI tile kernels at about 110 rows (1.1x at 128, 1.7x at 256, 3.1x at 2048; the
    # default model's four layer shapes, 2 threads, the widening included).
    prefill_min_rows: int = 128
    # ... where the AMX tile kernels (csrc/amx_tiles.cpp) take steps of prefill_min_rows rows instead: they
    # keep every row of a step in one call (no split), and outrun the GEMM up to about 1,280 prefill rows
    # (measured, default model, int4, 2 threads: a 128-token prompt beside 40 decode rows 70-79 ms against
    # 126-134 with the split; prompts alone: 512 tokens 136 / 158 ms, 1,024 227 / 252; the GEMM ahead from
    # 1,536, 324 / 352 ms, and 2,048, 459 / 532)
    amx_prefill_min_rows: int = 1280

    def method_for(self, prefix: str) -> str | None:
        """Name of the method the layer named `prefix` should use instead of this one; None: this one."""
        return self.lm_head_method if prefix.split(".")[-1] == "lm_head" else None

    def create_weights(self, layer: nn.Module) -> None:
        """Register layer.weight [out_features, in_features] (and layer.bias [out_features] if any)."""
        dtype = layer.params_dtype
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)
        layer.bias = (nn.Parameter(torch.empty(layer.out_features, dtype=dtype), requires_grad=False)
                      if layer.has_bias else None)

    def check_shape(self, layer: nn.Module) -> None:
        """Raise ValueError, naming the layer, if the kernel cannot take its shape."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded float32 layer.weight into this method's packed form."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] float32 -> [T, out_features] float32 (bias included)."""
        raise NotImplementedError

    def tile_weights(self, layer: nn.Module) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
        """(kind, tiles, scales or None) for csrc/gemv_kernels.cpp's gemv_<kind> over this layer's packed
        weights (also what csrc/decode_layer.h's DecodeLinear runs); None when `apply` is the only path."""
        return None

    def tile_scale_block(self, layer: nn.Module) -> int:
        """Inputs per scale of tile_weights' scales, for the native DecodeLinear; 0: the kernel's own rule."""
        return 0

    def tile_kernel(self, layer: nn.Module):
        """A function x [T, in] float32 -> [T, out] float32 (bias included) for T <= tile_max_rows, bound to
        this layer's tiles (tile_weights); None when `apply` is the only path."""
        found = self.tile_weights(layer)
        if found is None:
            return None
        from tokenmill.quant import tile_kernels
        kind, tiles, scales = found
        return tile_kernels.bind(layer, f"gemv_{kind}", tiles, *(() if scales is None else (scales,)))

    def prefill_kernel(self, layer: nn.Module):
        """A function x [P, in] float32 -> [P, out] float32 (bias included) for a step's prefill rows: the
        layer's int4 / int8 tiles widened to bfloat16 for one oneDNN GEMM (csrc/tile_widen.cpp), where the
        CPU has AMX tiles; None elsewhere (every row then runs the tile kernel or `apply`). Decode and verify
        rows never run it, so a generated token does not depend on what shares its step."""
        found = self.tile_weights(layer)
        from tokenmill.quant import tile_kernels
        if found is None or found[0] not in ("q4", "q8") or not tile_kernels.bf16_gemm_faster():
            return None
        return tile_kernels.bind_bf16(layer, *found)

    def prefill_rows_from(self) -> int:
        """The fewest prefill rows a step must have for them to run prefill_kernel's function (read once, when a
        layer takes this method): amx_prefill_min_rows where the AMX tile kernels take a step of
        prefill_min_rows rows (TOKENMILL_AMX_MIN_ROWS), else prefill_min_rows."""
        from tokenmill.quant import tile_kernels
        if tile_kernels.amx_tiles_take(self.prefill_min_rows):
            return max(self.amx_prefill_min_rows, self.prefill_min_rows)
        return self.prefill_min_rows

    def large_kernel(self, layer: nn.Module) -> tuple[str, torch.Tensor] | None:
        """(kind, weight) of the kernel `apply` runs for steps above tile_max_rows, for csrc/decode_layer.h's
        LargeLinear, which must compute exactly what `apply` does; None where it has no native twin."""
        return None

    def take_input_quant(self, layer: nn.Module, input_quant) -> None:
        """A pre-quantized checkpoint's activation quantization for this layer (quant/activations.py
        InputQuant). By default Linear.forward rounds the input with it before `apply` (the exact
        reference); a method whose kernel quantizes activations itself takes it over instead."""
        layer.input_quant = input_quant

    @staticmethod
    def drop_float_weight(layer: nn.Module) -> None:
        """Forget the float32 weight (a tied embedding keeps its own reference to the tensor)."""
        layer.weight = None

    @staticmethod
    def add_bias(layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        return y if layer.bias is None else y.add_(layer.bias)


class LoadedFloatMethod(QuantMethod):
    """A layer as built and loaded, before any method packs it: F.linear over its float weight, on any
    device. What Linear starts with; load_and_quantize replaces it with the platform's methods."""
    name = "loaded"
    is_float = True

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
