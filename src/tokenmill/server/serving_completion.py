"""POST /v1/completions: prompts as text, lists of text, token ids or lists of them; streaming or not.

Choice index = prompt index * n + completion index, as in OpenAI's API.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import Response

from tokenmill.outputs import CompletionOutput, TokenLogprobs
from tokenmill.server.errors import OpenAIError, bad_request
from tokenmill.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from tokenmill.server.serving_engine import (EngineCall, Serving, check_stream_options, in_thread, logprob_token_text,
                                            new_id, per_prompt_params)
from tokenmill.server.streaming import DONE, respond, sse


@dataclass
class _Prompts:
    token_ids: list[list[int]]
    texts: list[str | None]     # the prompt as text, for echo (None: decode the ids when needed)


async def create_completion(serving: Serving, req: CompletionRequest) -> Response:
    serving.check_model(req.model)
    check_stream_options(req)
    _reject_unsupported(req)
    prompts = await in_thread(_parse_prompts, serving, req.prompt)
    serving.check_logprobs(req.logprobs, "logprobs")
    # a budget per prompt: with max_tokens null, its own room in the context window (as in vLLM)
    budgets = [serving.resolve_max_tokens(len(p), req.max_tokens, "max_tokens") for p in prompts.token_ids]
    params = serving.sampling_params(req, min(budgets), req.logprobs, prompts.token_ids)
    call = serving.start(new_id("cmpl"), prompts.token_ids, per_prompt_params(params, budgets))
    return await respond(_CompletionWriter(serving, req, prompts, call), call.close, req.stream)


def _reject_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of different from n is not supported (best_of={req.best_of}, n={req.n})",
                          param="best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", param="echo")


def _parse_prompts(serving: Serving, prompt) -> _Prompts:
    if isinstance(prompt, str):
        return _Prompts([serving.encode(prompt, fit_context=True)], [prompt])
    if len(prompt) == 0:
        raise bad_request("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], str):
        return _Prompts([serving.encode(p, fit_context=True) for p in prompt], list(prompt))
    if isinstance(prompt[0], int):
        serving.check_token_ids(prompt, "prompt")
        return _Prompts([list(prompt)], [None])
    for ids in prompt:
        serving.check_token_ids(ids, "prompt")
    return _Prompts([list(ids) for ids in prompt], [None] * len(prompt))


class _CompletionWriter:
    """Turns cumulative engine outputs into OpenAI completion bodies (full or streamed)."""

    def __init__(self, serving: Serving, req: CompletionRequest, prompts: _Prompts, call: EngineCall) -> None:
        self.serving = serving
        self.req = req
        self.prompts = prompts
        self.call = call
        self.created = int(time.time())

    def _echo_text(self, prompt_index: int) -> str:
        text = self.prompts.texts[prompt_index]
        if text is None:
            text = self.serving.tokenizer.decode(self.prompts.token_ids[prompt_index])
        return text

    def _choice_index(self, prompt_index: int, o: CompletionOutput) -> int:
        return prompt_index * self.req.n + o.index

    async def full(self) -> CompletionResponse:
        async for _ in self.call.outputs():
            pass
        choices = []
        for pi, out in enumerate(self.call.final):
            if out is None:
                raise OpenAIError(500, f"engine ended request {self.call.engine_ids[pi]} without a final output",
                                  type="server_error")
            prefix = self._echo_text(pi) if self.req.echo else ""
            for o in out.outputs:
                lps = None
                if self.req.logprobs is not None:
                    lps = _logprobs(self.serving.tokenizer, o.logprobs or [], len(prefix))
                choices.append(CompletionChoice(index=self._choice_index(pi, o), text=prefix + o.text, logprobs=lps,
                                                finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=self.call.request_id, created=self.created, model=self.serving.model_name,
                                  choices=choices, usage=self.call.usage())

    async def stream(self) -> AsyncIterator[bytes]:
        sent_chars: dict[int, int] = {}     # choice index -> characters of o.text already sent
        sent_lps: dict[int, int] = {}       # choice index -> logprob entries already sent
        offsets: dict[int, int] = {}        # choice index -> text_offset of the next token
        done: set[int] = set()
        async for pi, out in self.call.outputs():
            for o in out.outputs:
                idx = self._choice_index(pi, o)
                if idx in done:
                    continue
                first = idx not in sent_chars
                start = sent_chars.get(idx, 0)
                delta = o.text[start:]
                prefix = self._echo_text(pi) if (first and self.req.echo) else ""
                lps = None
                if self.req.logprobs is not None:
                    new = (o.logprobs or [])[sent_lps.get(idx, 0):]
                    sent_lps[idx] = sent_lps.get(idx, 0) + len(new)
                    lps = _logprobs(self.serving.tokenizer, new, offsets.get(idx, 0) + len(prefix))
                    offsets[idx] = offsets.get(idx, 0) + len(prefix) + sum(len(t) for t in lps.tokens)
                sent_chars[idx] = len(o.text)
                if o.finish_reason is not None:
                    done.add(idx)
                elif not delta and not prefix and not (lps and lps.tokens):
                    continue
                choice = CompletionChoice(index=idx, text=prefix + delta, logprobs=lps,
                                          finish_reason=o.finish_reason, stop_reason=o.stop_reason)
                yield sse(CompletionResponse(id=self.call.request_id, created=self.created,
                                             model=self.serving.model_name, choices=[choice]))
        if self.req.include_usage_in_stream:
            yield sse(CompletionResponse(id=self.call.request_id, created=self.created,
                                         model=self.serving.model_name, choices=[], usage=self.call.usage()))
        yield DONE


def _logprobs(tokenizer, entries: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        token = logprob_token_text(tokenizer, e.sampled.token_id, e.sampled.decoded)
        out.tokens.append(token)
        out.token_logprobs.append(e.sampled.logprob)
        top = {logprob_token_text(tokenizer, t.token_id, t.decoded): t.logprob for t in e.top}
        top.setdefault(token, e.sampled.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out
