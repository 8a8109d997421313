"""FP8 (E4M3) KV cache: one byte a value, a float32 scale per layer and kv head.

    stored code = clamp(x / scale[h], -448, 448) rounded to float8_e4m3fn      (448: E4M3's largest value)
    read value  = float32(code) * scale[h]

Scales come from the checkpoint (`self_attn.k_scale` / `v_scale`, one per layer, as ModelOpt and vLLM
write them) or are calibrated from the first keys and values a layer writes: per kv head, amax x
HEADROOM / 448, so later values up to HEADROOM times the first ones' largest still fit (beyond that they
saturate, never NaN). Relative error of a stored value: at most 2^-4 (3 mantissa bits), down to E4M3's
subnormals at 2^-9 x scale.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
HEADROOM = 4.0


class KVScales:
    """One attention layer's FP8 cache scales: k, v [num_kv_heads] float32, fixed once set. Set and calibrated
    in place: the native decoder layer (platforms/cpu_decode.py) holds these tensors."""

    def __init__(self, num_kv_heads: int) -> None:
        self.k = torch.ones(num_kv_heads)
        self.v = torch.ones(num_kv_heads)
        self.ready = False              # False until calibrated or loaded from the checkpoint

    def set(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Checkpoint scales: a scalar per layer or one per kv head."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not bool((value > 0).all()) or not bool(torch.isfinite(value).all()):
                raise ValueError(f"checkpoint {name} must be finite and > 0, got {value.tolist()}")
        self.k.copy_(k_scale.float().reshape(-1).expand(self.k.numel()))
        self.v.copy_(v_scale.float().reshape(-1).expand(self.v.numel()))
        self.ready = True

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """From the first keys/values written, k/v [T, KV, D]; a no-op once set."""
        if self.ready:
            return
        self.k.copy_(_scale_of(k))
        self.v.copy_(_scale_of(v))
        self.ready = True

    def to(self, device) -> "KVScales":
        self.k, self.v = self.k.to(device), self.v.to(device)
        return self


def _scale_of(x: torch.Tensor) -> torch.Tensor:
    amax = x.detach().float().abs().amax(dim=(0, 2))                # [KV]
    return torch.where(amax > 0, amax * (HEADROOM / FP8_MAX), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, KV, D] float -> codes [T, KV, D] float8_e4m3fn (saturating)."""
    return (x.float() / scale.view(1, -1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [KV, ...] float8_e4m3fn -> float32, times each kv head's scale."""
    return codes.to(torch.float32) * scale.view(-1, *([1] * (codes.dim() - 1)))


def write_fp8_cache(k, v, k_cache, v_cache, slot_mapping, scales: KVScales) -> None:
    """k, v [T, KV, D] -> their slots of the float8 [KV, num_slots, D] caches (calibrating scales first)."""
    scales.calibrate(k, v)                         # index_copy_ has no float8 kernel: copy the bytes
    k_cache.view(torch.uint8).index_copy_(1, slot_mapping, quantize(k, scales.k).transpose(0, 1).view(torch.uint8))
    v_cache.view(torch.uint8).index_copy_(1, slot_mapping, quantize(v, scales.v).transpose(0, 1).view(torch.uint8))


def scale_pair(kv_scales: KVScales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k scale, v scale) for read_slots: both None for a float cache."""
    return (kv_scales.k, kv_scales.v) if kv_scales is not None else (None, None)


def read_slots(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """cache[:, slots] [KV, len(slots), D]: dequantized to float32 when scale is given (an FP8 cache), else in
    the cache's own dtype (callers widen a bfloat16 cache's rows to their compute dtype)."""
    rows = cache.index_select(1, slots)
    return rows if scale is None else dequantize(rows, scale)
