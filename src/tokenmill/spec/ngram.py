"""Prompt lookup (n-gram) drafts: find the most recent earlier occurrence of the request's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) in its own prompt and output, and propose the k
tokens that followed it. Costs no model; pays off where outputs repeat their input (summaries, code
edits, extraction).

Per request an index maps every n-gram (n in [min, max]) to the position where its latest occurrence
ends, built incrementally one token behind the end (so the current suffix finds an earlier occurrence,
never itself): O(max - min + 1) per new token and per proposal."""
from __future__ import annotations

from typing import Sequence

from tokenmill.spec.base import Proposer


class _Index:
    __slots__ = ("upto", "ends")

    def __init__(self) -> None:
        self.upto = 0                          # n-grams ending before position `upto` are indexed
        self.ends: dict[tuple, int] = {}       # n-gram -> position of its last token, latest occurrence


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        total = len(token_ids)
        if k <= 0 or total <= self.lo:
            return []
        index = self.indexes.get(request_id)
        if index is None or index.upto > total - 1:          # new, or its tokens were cut back
            index = self.indexes[request_id] = _Index()
        self._extend(index, token_ids, total - 1)
        for n in range(min(self.hi, total - 1), self.lo - 1, -1):
            end = index.ends.get(tuple(token_ids[total - n:total]))
            if end is not None:
                return list(token_ids[end + 1:end + 1 + k])
        return []

    def _extend(self, index: _Index, tokens: Sequence[int], upto: int) -> None:
        ends, lo, hi = index.ends, self.lo, self.hi
        for t in range(index.upto, upto):
            for n in range(lo, min(hi, t + 1) + 1):
                ends[tuple(tokens[t - n + 1:t + 1])] = t
        index.upto = max(index.upto, upto)

    def drop(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
