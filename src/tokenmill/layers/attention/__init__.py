"""Paged attention backends. Each backend reads the same AttentionMetadata; add one by adding a file
and an entry in BACKENDS."""
from __future__ import annotations

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata, SeqSpan


def get_backend(name: str) -> AttentionBackend:
    from tokenmill.layers.attention.cpu import CPUAttention
    from tokenmill.layers.attention.reference import ReferenceAttention
    backends = {"reference": ReferenceAttention, "cpu": CPUAttention}
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(backends)}")
    return backends[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSpan", "get_backend"]
