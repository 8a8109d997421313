"""FP8 E4M3 weights on the CPU: one byte a weight, decoded in the kernel (to float32 in csrc/moe_kernels.cpp's
grouped GEMM with one group: the 7 magnitude bits moved into float32's exponent and mantissa; to bfloat16 in
the fast mode's kernels), times a float32 scale per output row and block of inputs:

    w[n, k] = fp8[n, k] * scale[n, k // kblock]        kblock = K (per tensor / per channel), 128 (blocks) or
                                                       the group size (groups: 16, 32 or a multiple of 64)

Steps of up to `tile_max_rows` rows (decode):
- the fast mode (`bf16_activations`, the default) where the build has AVX-512 FP16 (Sapphire Rapids and
  later): fp8_gemv_f16, the codes widened to fp16 in registers by shifts (exact), each row of activations
  scaled by a power of two and rounded to fp16, fp16 FMAs summing at most 8 products a lane before float32
  (relative error about 4e-4 of the output's norm, a quarter of bfloat16's); scales per row or per a
  multiple of 64 inputs only (its fp16 sums span 4 chunks of 64);
- the fast mode where the build has AVX-512 BF16 and VBMI but not FP16 (Zen 4), and for layers with scales
  per 16 or 32 inputs where it has both: fp8_gemv_bf16, the codes
  widened to bfloat16 in registers by table lookups (exact), the activations rounded to bfloat16, the
  products summed in float32 (vdpbf16ps), a block's sum times its scale in float32;
- otherwise float32 activations (the grouped GEMM: each code decoded to float32 in registers), the exact
  reference of the format (this CPU has no FP8 arithmetic).

Scales come from the checkpoint where it is pre-quantized (quant/prequantized.py attaches them to the layer
as `checkpoint_fp8`: per shard of a fused layer, the strategy and the scale), so the codes are the
checkpoint's own; otherwise (quantization="fp8" on a float checkpoint) per output channel, amax / 448.
Steps of more than `tile_max_rows` rows (prefill chunks, large decode batches):
- the fast mode (`bf16_activations`, where the build has AVX-512 BF16; the default): one bfloat16 GEMM with
  float32 sums (fp8_linear_bf16: the codes widened to bfloat16 natively, exact; with block or group scales
  each code x scale rounded to bfloat16), the activations and the output rounded to bfloat16 (relative
  error about 2^-9 each; measured 2-3e-3 of the output's norm), twice the float32 GEMM's rate with AVX-512
  BF16, about seven times with AMX (oneDNN uses its tiles where the CPU has them). This CPU has
  no integer form of E4M3 (its values span 16 binades), so int4's int8-activation route is closed.
- the exact mode (`FP8Method(bf16_activations=False)`, or the class attribute for every engine built after):
  the layer's weight dequantized natively into a temporary float32 [N, K] (fp8_dequantize: bitwise
  `dequantize` below) and one float32 GEMM.
Without the native build, `apply` dequantizes the layer's weight per call in torch (slow, exact)."""
from __future__ import annotations

import torch

from tokenmill.quant import tile_kernels
from tokenmill.quant.base import QuantMethod

E4M3_MAX = 448.0
BLOCK = 128                       # DeepSeek's and compressed-tensors' block size (both dims)


class FP8Method(QuantMethod):
    name = "fp8"
    # quantization="fp8" on a float checkpoint gives a tied head its own copy (its bytes dominate small
    # models' decode steps) in int8: 3 mantissa bits on the head cost the default model +2.5% perplexity.
    # Pre-quantized checkpoints keep whatever they keep float.
    quantize_tied_lm_head = True
    lm_head_method = "int8"
    # Steps of up to tile_max_rows rows run dot products with each weight decoded in registers (the fast
    # mode's bfloat16 kernel, or the exact mode's float32 grouped GEMM); larger ones the fast mode's oneDNN
    # bfloat16 GEMM, or in the exact mode the weight dequantized to float32 (a temporary [N, K]) and one
    # float32 GEMM. The limits are where the larger kernel gets faster per step (default model's shapes,
    # benchmarks/fp8_kernels.py); the native decoder layer runs the same kernels. FAST_MAX_ROWS is measured
    # with the weights read from memory, as a decode step's 30 layers read them (Zen 4, 2 threads, the 120
    # decode linears: gemv / GEMM 20.6 / 23.0 ms at 16 rows, 28.8 / 27.5 at 24), and in cache too (the four
    # shapes at 16 rows: 0.66-0.83 / 0.69-1.01 ms).
    EXACT_MAX_ROWS = 40
    FAST_F16_MAX_ROWS = 14           # fp8_gemv_f16 below, oneDNN's bfloat16 GEMM above
    FAST_MAX_ROWS = 16               # builds without AVX-512 FP16: fp8_gemv_bf16 below
    FAST_GROUPED_MAX_ROWS = 16       # builds with AVX-512 BF16 but neither kernel: float32 below
    bf16_activations = True          # the fast mode (AVX-512 BF16 builds; small steps in fp16 with AVX-512 FP16)

    def __init__(self, bf16_activations: bool | None = None) -> None:
        # pinned per instance: the class attribute read when the engine is built sets the mode it keeps
        self.bf16_activations = type(self).bf16_activations if bf16_activations is None else bf16_activations

    def bf16_kernel(self):
        """csrc's fp8_linear_bf16 (steps above tile_max_rows) in the fast mode where the build has it, else
        None."""
        native = tile_kernels.kernels() if self.bf16_activations else None
        return getattr(native, "fp8_linear_bf16", None)

    def fast_gemv(self, layer=None) -> tuple[str, object] | None:
        """The fast mode's kernel for steps of up to tile_max_rows, as (decoder-layer kind, function): csrc's
        fp8_gemv_f16 where the build has it (AVX-512 FP16) and the layer's scale blocks are whole chunks of 64
        inputs, else fp8_gemv_bf16 (AVX-512 BF16 and VBMI; also blocks of 16 or 32); None in the exact mode or
        where the build has neither."""
        native = tile_kernels.kernels() if self.bf16_activations else None
        kblock = getattr(layer, "fp8_kblock", 0)
        f16_takes = layer is None or kblock == layer.in_features or kblock % 64 == 0
        for kind, name in (("fp8_f16", "fp8_gemv_f16"), ("fp8_bf16", "fp8_gemv_bf16")):
            kernel = getattr(native, name, None)
            if kernel is not None and (kind != "fp8_f16" or f16_takes):
                return kind, kernel
        return None

    @property
    def tile_max_rows(self) -> int:
        if self.bf16_kernel() is None:
            return self.EXACT_MAX_ROWS
        gemv = self.fast_gemv()
        if gemv is None:
            return self.FAST_GROUPED_MAX_ROWS
        return self.FAST_F16_MAX_ROWS if gemv[0] == "fp8_f16" else self.FAST_MAX_ROWS

    def check_shape(self, layer) -> None:
        if layer.in_features % 8:
            raise ValueError(f"fp8 quantization of {layer.prefix or 'a linear layer'} [{layer.out_features}, "
                             f"{layer.in_features}] needs in_features a multiple of 8")

    def process_weights_after_loading(self, layer) -> None:
        if getattr(layer, "fp8_weight", None) is None:          # not already given the checkpoint's codes
            self._quantize(layer, layer.weight.data.float())
        self.drop_float_weight(layer)

    def _quantize(self, layer, w: torch.Tensor) -> None:
        parts = getattr(layer, "checkpoint_fp8", None) or [(slice(0, w.shape[0]), "channel", None)]
        kblock = _kblock(parts, w.shape[1])
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(w.shape[0], -(-w.shape[1] // kblock))
        for rows, strategy, scale in parts:
            full = expand_scale(w[rows], strategy, scale, kblock)       # [n, K / kblock]
            q[rows] = quantize_with(w[rows], full, kblock)
            scales[rows] = full
        self._register(layer, q, scales, kblock, w.device)

    def set_codes(self, layer, codes: list, device: torch.device) -> None:
        """The checkpoint's own codes, kept as they are (no float copy): codes = [(rows of the layer,
        float8_e4m3fn [n, K])], one per shard of `checkpoint_fp8` (the same rows), covering the layer."""
        parts = layer.checkpoint_fp8
        kblock = _kblock(parts, layer.in_features)
        q = torch.empty(layer.out_features, layer.in_features, dtype=torch.float8_e4m3fn)
        scales = torch.empty(layer.out_features, -(-layer.in_features // kblock))
        by_rows = {(rows.start, rows.stop): c for rows, c in codes}
        for rows, strategy, scale in parts:
            c = by_rows[(rows.start, rows.stop)]
            if c.dtype != torch.float8_e4m3fn or c.shape != q[rows].shape:
                raise ValueError(f"{layer.prefix or 'a linear layer'}: an FP8 weight must be float8_e4m3fn "
                                 f"{tuple(q[rows].shape)}, got {c.dtype} {tuple(c.shape)}")
            q[rows] = c
            scales[rows] = expand_scale(c, strategy, scale, kblock, f"{layer.prefix or 'a linear layer'}'s FP8 scale "
                                        f"of rows {rows.start}:{rows.stop}")
        self._register(layer, q, scales, kblock, device)

    @staticmethod
    def _register(layer, q: torch.Tensor, scales: torch.Tensor, kblock: int, device=None) -> None:
        """The layer's buffers (on the CPU: device is the loading device, unused here)."""
        layer.register_buffer("fp8_weight", q.unsqueeze(0).contiguous(), persistent=False)    # [1, N, K]
        layer.register_buffer("fp8_scale", scales.unsqueeze(0).contiguous(), persistent=False)  # [1, N, KB]
        layer.fp8_kblock = kblock

    def tile_weights(self, layer):
        """(kind, codes [1, N, K], scales [1, N, KB]) for csrc/decode_layer.cpp's DecodeLinear, which runs the
        same kernel as `apply`: kind "fp8" (the grouped GEMM) or, in the fast mode, fast_gemv's ("fp8_f16",
        "fp8_bf16"); None without the native tile kernels (no native decoder layer)."""
        if tile_kernels.kernels() is None or not hasattr(tile_kernels.kernels(), "moe_grouped_gemm"):
            return None
        gemv = self.fast_gemv(layer)
        return ("fp8" if gemv is None else gemv[0]), layer.fp8_weight, layer.fp8_scale

    def tile_scale_block(self, layer) -> int:
        return layer.fp8_kblock

    def tile_kernel(self, layer):
        """`apply` itself (tile_weights only names its kernels for the decoder layer)."""
        return (lambda x: self.apply(layer, x)) if self.tile_weights(layer) is not None else None

    def large_kernel(self, layer):
        """Above tile_max_rows: csrc/decode_layer.cpp's LargeLinear "fp8_bf16" (the fast mode's bfloat16
        GEMM) or "fp8" (fp8_dequantize, then the float32 GEMM), as `apply` runs it."""
        if self.tile_weights(layer) is None:
            return None
        return ("fp8_bf16" if self.bf16_kernel() is not None else "fp8"), layer.fp8_weight

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.tile_max_rows and self.tile_weights(layer) is not None:
            fast = self.bf16_kernel()
            if fast is not None:
                y = fast(x.float().contiguous(), layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock)
                return self.add_bias(layer, y)
            w = tile_kernels.kernels().fp8_dequantize(layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock)
            return torch.nn.functional.linear(x.float(), w, layer.bias)
        gemv = self.fast_gemv(layer)
        if gemv is not None:
            y = gemv[1](x.float(), layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock)
            return self.add_bias(layer, y)
        y = grouped_linear(x, layer.fp8_weight, layer.fp8_scale, layer.fp8_kblock,
                           lambda: dequantize(layer.fp8_weight[0], layer.fp8_scale[0], layer.fp8_kblock))
        return self.add_bias(layer, y)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, kblock: int, dequantized,
                   row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ the scaled codes' weight^T through the native grouped GEMM with one group (weight [1, N, ...],
    scale [1, N, K / kblock], and row_scale [1, N] with E4M3 scales); without the native build,
    x @ dequantized()^T (slow, exact)."""
    from tokenmill.platforms import cpu_native
    native = cpu_native.load()
    xf = x.float().contiguous()
    if native is not None and hasattr(native, "moe_grouped_gemm"):
        return native.moe_grouped_gemm(xf, _one_run(xf.shape[0]), weight, scale, kblock, row_scale)
    return torch.nn.functional.linear(xf, dequantized())


_ONE_RUN: dict[int, torch.Tensor] = {}     # rows -> run_starts [0, rows] (read-only; made once per size)


def _one_run(rows: int) -> torch.Tensor:
    starts = _ONE_RUN.get(rows)
    if starts is None:
        starts = torch.tensor([0, rows], dtype=torch.long)
        if len(_ONE_RUN) < 4096:
            _ONE_RUN[rows] = starts
    return starts


def check_group(group: int) -> int:
    """An FP8 group size the kernels take (16, 32 or a multiple of 64: the fast mode's gemv scales a chunk of
    64 inputs lane by lane, or whole chunks), else ValueError naming it."""
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group not in (16, 32) and group % 64:
        raise ValueError(f"FP8 group scales of {group!r} inputs are not supported; supported: groups of 16, 32 or "
                         "a multiple of 64 inputs")
    return group


def scale_shapes(strategy: str, n: int, k: int, group: int = 0) -> tuple[tuple[int, ...], ...]:
    """The shapes a checkpoint's scale of an FP8 weight [n, k] may have: per tensor one value ([], [1]),
    per channel [n, 1] or [n], in 128 x 128 blocks [ceil(n / 128), ceil(k / 128)], per row and group of
    `group` inputs [n, k / group] (none where k is not a multiple of group)."""
    if strategy == "tensor":
        return (), (1,), (1, 1)
    if strategy == "channel":
        return (n, 1), (n,)
    if strategy == "block":
        return ((-(-n // BLOCK), -(-k // BLOCK)),)
    if strategy == "group":
        return ((n, k // group),) if group > 0 and k % group == 0 else ()
    raise ValueError(f"unknown FP8 scale strategy {strategy!r}")


def expand_scale(w: torch.Tensor, strategy: str, scale: torch.Tensor | None, kblock: int,
                 name: str = "an FP8 weight's scale") -> torch.Tensor:
    """The scale of every (row, block of kblock inputs) of w [n, K]: from the checkpoint's per-tensor [1],
    per-channel [n] / [n, 1], block [n / 128, K / 128] or group [n, K / kblock] scale (w is then only its
    shape: codes do; a scale of another shape is a ValueError naming `name`), or (None) amax / 448 per row."""
    n, k = w.shape
    kb = -(-k // kblock)
    if scale is None:
        amax = w.abs().amax(dim=1, keepdim=True)
        return (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny).expand(n, kb).contiguous()
    expected = scale_shapes(strategy, n, k, kblock)
    if tuple(scale.shape) not in expected:
        want = " or ".join(str(list(e)) for e in expected) or f"none: K = {k} is not a multiple of {kblock}"
        raise ValueError(f"{name} has shape {list(scale.shape)}, expected {want} ({strategy} scales of a weight "
                         f"[{n}, {k}]{f' in groups of {kblock}' if strategy == 'group' else ''})")
    scale = scale.float()
    if strategy == "group":
        return scale.contiguous()
    if strategy == "tensor":
        return scale.reshape(1, 1).expand(n, kb).contiguous()
    if strategy == "channel":
        return scale.reshape(n, 1).expand(n, kb).contiguous()
    if strategy == "block":                          # [ceil(n / 128), ceil(k / 128)] -> per row
        return scale.repeat_interleave(BLOCK, dim=0)[:n, :kb].contiguous()
    raise ValueError(f"unknown FP8 scale strategy {strategy!r}")


def full_scale(scale: torch.Tensor, strategy: str, n: int, k: int) -> torch.Tensor:
    """The checkpoint's weight scale as every weight's [n, K] (differentiable: scale tuning trains it)."""
    kblock = scale_block(strategy, scale, k)
    per_block = expand_scale(torch.empty(n, k, device="meta"), strategy, scale, kblock)
    return per_block.repeat_interleave(kblock, dim=1)[:, :k]


def scale_block(strategy: str, scale: torch.Tensor | None, k: int) -> int:
    """Inputs per scale of a weight [., k] with this strategy: 128 for blocks, k / scale's columns for groups
    (scale [n, k / group]), else k."""
    if strategy == "block":
        return BLOCK
    if strategy == "group":
        if scale is None or scale.dim() != 2 or scale.shape[1] == 0 or k % scale.shape[1]:
            raise ValueError(f"FP8 group scales must be [N, K / group] with K = {k}, got "
                             f"{None if scale is None else list(scale.shape)}")
        return k // scale.shape[1]
    return k


def _kblock(parts, k: int) -> int:
    """Inputs per scale of a layer whose shards are `parts` (rows, strategy, scale): 128 when any shard's
    scales are 128 x 128 blocks, the group size for group scales (every shard's the same), else the row."""
    blocks = {scale_block(strategy, scale, k) for _, strategy, scale in parts}
    if len(blocks) == 1:
        return blocks.pop()
    if any(strategy == "group" for _, strategy, _ in parts):
        raise ValueError(f"a fused layer's FP8 shards have scales per different numbers of inputs: {sorted(blocks)}")
    return BLOCK


def quantize_with(w: torch.Tensor, scales: torch.Tensor, kblock: int) -> torch.Tensor:
    """w [n, K] / scale per (row, block) -> float8_e4m3fn codes (round to nearest, saturating at 448)."""
    full = scales.repeat_interleave(kblock, dim=1)[:, :w.shape[1]]
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scales: torch.Tensor, kblock: int) -> torch.Tensor:
    """float8 codes [n, K] and scales [n, K / kblock] -> float32 weights."""
    return q.float() * scales.repeat_interleave(kblock, dim=1)[:, :q.shape[1]]
