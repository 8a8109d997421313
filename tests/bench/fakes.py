"""Test doubles: a fake engine with the AsyncEngine API and a whitespace tokenizer."""
from __future__ import annotations

import asyncio

from tokenmill.outputs import CompletionOutput, RequestOutput


class WordTokenizer:
    """Each space-separated word is one token (id = len(word)); enough for counting."""
    all_special_ids = [0]
    vocab_size = 1000

    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]

    def decode(self, ids):
        return " ".join("x" * max(i % 7, 1) for i in ids)


class FakeAsyncEngine:
    """Generates `max_tokens` tokens (or `natural_len` without ignore_eos) with fixed delays,
    `tokens_per_step` per update; raises on prompts equal to "boom"."""

    def __init__(self, ttft_s=0.0, step_s=0.0, tokens_per_step=1, natural_len=4):
        self.tokenizer = WordTokenizer()
        self.ttft_s, self.step_s, self.k, self.natural_len = ttft_s, step_s, tokens_per_step, natural_len
        self.aborted: list[str] = []
        self.params: list = []
        self.shut = False

    async def generate(self, prompt, params, request_id):
        if prompt == "boom":
            raise RuntimeError("kaboom")
        self.params.append(params)
        n = params.max_tokens if params.ignore_eos else min(params.max_tokens, max(self.natural_len,
                                                                                   params.min_tokens))
        prompt_ids = list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        ids: list[int] = []
        await asyncio.sleep(self.ttft_s)
        while len(ids) < n:
            new = [7] * min(self.k, n - len(ids))
            ids += new
            done = len(ids) == n
            comp = CompletionOutput(0, "tok " * len(ids), list(ids), finish_reason="length" if done else None,
                                    new_token_ids=new)
            yield RequestOutput(request_id, None, prompt_ids, [comp], finished=done)
            if not done:
                await asyncio.sleep(self.step_s)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def shutdown(self):
        self.shut = True
