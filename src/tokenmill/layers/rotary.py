"""Rotary position embeddings (Hugging Face "rotate half" layout), with llama3 and linear scaling."""
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
    raise ValueError(f"unsupported RoPE scaling type {kind!r}; supported: default, linear, llama3")


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
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                       # [max_positions, head_dim // 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.kernel = op_kernels().rotary

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, head_dim // 2]: once per step, shared by every layer."""
        return self.cos[positions], self.sin[positions]

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """cos_sin from gather(); q [T, num_heads, head_dim]; k [T, num_kv_heads, head_dim] -> rotated (q, k),
        possibly in place (they are views of this step's fresh projection)."""
        return self.kernel(q, k, *cos_sin)
