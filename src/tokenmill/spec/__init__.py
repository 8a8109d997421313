"""Speculative decoding: proposers guess the next few tokens of a request; the target model checks them
all in one step (sample/rejection.py) and keeps the longest acceptable run plus one token of its own.

    proposer = make_proposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    drafts = proposer.propose(request_tokens, k)      # up to k draft ids

One file per proposer, registered by method name (vLLM's names)."""
from __future__ import annotations

import importlib

from tokenmill.spec.base import Proposer

PROPOSERS = {"ngram": "tokenmill.spec.ngram:NgramProposer",     # method -> module:class, imported lazily
             "mtp": "tokenmill.spec.mtp:MTPProposer",
             "draft_model": "tokenmill.spec.draft_model:DraftModelProposer"}


def make_proposer(config) -> Proposer:
    if config.method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {config.method!r}; supported: {sorted(PROPOSERS)}")
    module, cls = PROPOSERS[config.method].split(":")
    return getattr(importlib.import_module(module), cls)(config)


__all__ = ["PROPOSERS", "Proposer", "make_proposer"]
