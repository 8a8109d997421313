"""Rotary position embeddings: Hugging Face's "rotate half" layout, or DeepSeek's interleaved pairs; with
llama3, linear and yarn scaling (yarn also scales cos and sin by its attention factor)."""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.platforms import op_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """[head_dim // 2] inverse frequencies, float64 then float32, scaled as the HF config asks."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type")
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling).float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: default, linear, llama3, yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: yarn's attention factor (1 for every other kind)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): interpolated frequencies below the correction range, the original ones above
    it, a linear ramp between (float32, as Hugging Face computes it)."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 interleaved: bool = False) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                       # [max_positions, head_dim // 2]
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)
        self.kernel = interleaved_rotary if interleaved else op_kernels().rotary

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, head_dim // 2]: once per step, shared by every layer."""
        return self.cos[positions], self.sin[positions]

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """cos_sin from gather(); q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim] -> rotated (q, k),
        possibly in place (they are views of this step's fresh projection)."""
        return self.kernel(q, k, *cos_sin)


def interleaved_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """DeepSeek's layout: dims (2i, 2i+1) form pair i. q [T, H, D], k [T, H_k, D], cos/sin [T, D // 2] ->
    rotated q, k with the pairs' first elements in the first half and second elements in the second (the
    same layout for q and k, so q.k is as in the checkpoint's model)."""
    c, s = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)

    def rotate(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return rotate(q), rotate(k)
