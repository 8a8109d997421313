"""Reusable [rows, vocab] buffers for the sampler.

A fresh 12 MB CPU tensor (64 x 49152 float32) costs thousands of page faults on first touch, which here
was slower than the arithmetic done in it; the sampler therefore keeps a few named buffers and reuses
them every step. They grow to the largest batch seen and are never shrunk.
"""
from __future__ import annotations

import torch


class Workspace:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, cols: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A [rows, cols] contiguous tensor with undefined contents, valid until the next take(name)."""
        needed = rows * cols
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < needed or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(needed, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:needed].view(rows, cols)
