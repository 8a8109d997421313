"""Paged attention backends. Each backend reads the same AttentionMetadata; add one by adding a file
and an entry in BACKENDS."""
from __future__ import annotations

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata, SeqSpan


BACKENDS = {"reference": "tokenmill.layers.attention.reference:ReferenceAttention",
            "cpu": "tokenmill.layers.attention.cpu:CPUAttention",
            "triton": "tokenmill.layers.attention.triton_backend:TritonAttention"}   # name -> module:class, imported lazily


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(BACKENDS)}")
    import importlib
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSpan", "get_backend"]
