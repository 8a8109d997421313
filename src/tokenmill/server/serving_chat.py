"""POST /v1/chat/completions: messages rendered through the model's chat template; streaming or not."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import Response

from tokenmill.outputs import TokenLogprobs
from tokenmill.server.errors import OpenAIError, bad_request
from tokenmill.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatMessage, ChatStreamChoice,
                                       DeltaMessage, TokenLogprob, TopLogprob)
from tokenmill.server.serving_engine import (EngineCall, Serving, check_stream_options, in_thread, logprob_token_text,
                                            new_id)
from tokenmill.server.streaming import DONE, respond, sse


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest) -> Response:
    serving.check_model(req.model)
    check_stream_options(req)
    _reject_unsupported(req)
    prompt_ids = await in_thread(render_chat, serving, req.messages, req.add_generation_prompt,
                                 req.chat_template_kwargs, True)
    if req.top_logprobs is not None:
        serving.check_logprobs(req.top_logprobs, "top_logprobs")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = serving.resolve_max_tokens(len(prompt_ids), requested, param)
    params = serving.sampling_params(req, max_tokens, num_logprobs, [prompt_ids])
    call = serving.start(new_id("chatcmpl"), [prompt_ids], [params])
    return await respond(_ChatWriter(serving, req, call), call.close, req.stream)


def _reject_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise bad_request("tools are not supported", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(f"response_format {req.response_format.get('type')!r} is not supported; only 'text'",
                          param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


def render_chat(serving: Serving, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict | None = None, fit_context: bool = False) -> list[int]:
    """Messages -> prompt token ids through the tokenizer's chat template (the template adds BOS if any).
    fit_context: see Serving.encode."""
    tokenizer = serving.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(f"model '{serving.model_name}' has no chat template; use /v1/completions",
                          param="messages")
    plain = [_plain_message(m, i) for i, m in enumerate(messages)]
    if template_kwargs and "chat_template" in template_kwargs:   # arbitrary Jinja: unbounded time and memory
        raise bad_request("chat_template_kwargs may not replace the server's chat template ('chat_template')",
                          param="chat_template_kwargs.chat_template")
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - template errors come from the request's content
        raise bad_request(f"could not apply the chat template to messages: {type(e).__name__}: {e}",
                          param="messages") from None
    if not isinstance(text, str):   # chat_template_kwargs asked the tokenizer for something else
        raise bad_request(f"chat_template_kwargs made the chat template return {type(text).__name__}, not text",
                          param="chat_template_kwargs")
    return serving.encode(text, add_special_tokens=False, fit_context=fit_context)


# OpenAI's roles ("function" is its deprecated form of "tool"); only the assistant may leave content out
# (a message that carries tool calls instead).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _plain_message(m: ChatMessage, i: int) -> dict:
    if m.role not in CHAT_ROLES:
        raise bad_request(f"messages[{i}].role: unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}",
                          param=f"messages.{i}.role")
    if m.content is None and m.role != "assistant":
        raise bad_request(f"messages[{i}].content is required for a {m.role} message",
                          param=f"messages.{i}.content")
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{i}].content: part type {part.type!r} is not supported; only 'text'",
                                  param=f"messages.{i}.content")
            texts.append(part.text)
        d["content"] = "".join(texts)
    d.setdefault("content", "")
    return d


class _ChatWriter:
    def __init__(self, serving: Serving, req: ChatCompletionRequest, call: EngineCall) -> None:
        self.serving = serving
        self.req = req
        self.call = call
        self.created = int(time.time())

    def _logprobs(self, entries: list[TokenLogprobs]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return ChatLogprobs(content=[_token_logprob(self.serving.tokenizer, e) for e in entries])

    async def full(self) -> ChatCompletionResponse:
        async for _ in self.call.outputs():
            pass
        out = self.call.final[0]
        if out is None:
            raise OpenAIError(500, f"engine ended request {self.call.engine_ids[0]} without a final output",
                              type="server_error")
        choices = [ChatChoice(index=o.index, message=AssistantMessage(content=o.text),
                              logprobs=self._logprobs(o.logprobs or []), finish_reason=o.finish_reason,
                              stop_reason=o.stop_reason)
                   for o in sorted(out.outputs, key=lambda o: o.index)]
        return ChatCompletionResponse(id=self.call.request_id, created=self.created, model=self.serving.model_name,
                                      choices=choices, usage=self.call.usage())

    def _chunk(self, choices: list[ChatStreamChoice], usage=None) -> bytes:
        return sse(ChatCompletionChunk(id=self.call.request_id, created=self.created,
                                       model=self.serving.model_name, choices=choices, usage=usage))

    async def stream(self) -> AsyncIterator[bytes]:
        for i in range(self.req.n):
            yield self._chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        sent_chars: dict[int, int] = {}
        sent_lps: dict[int, int] = {}
        done: set[int] = set()
        async for _, out in self.call.outputs():
            for o in out.outputs:
                if o.index in done:
                    continue
                delta = o.text[sent_chars.get(o.index, 0):]
                sent_chars[o.index] = len(o.text)
                new_lps = (o.logprobs or [])[sent_lps.get(o.index, 0):]
                sent_lps[o.index] = sent_lps.get(o.index, 0) + len(new_lps)
                if o.finish_reason is not None:
                    done.add(o.index)
                elif not delta and not (self.req.logprobs and new_lps):
                    continue
                choice = ChatStreamChoice(index=o.index, delta=DeltaMessage(content=delta or None),
                                          logprobs=self._logprobs(new_lps), finish_reason=o.finish_reason)
                yield self._chunk([choice])
        if self.req.include_usage_in_stream:
            yield self._chunk([], usage=self.call.usage())
        yield DONE


def _token_logprob(tokenizer, e: TokenLogprobs) -> TokenLogprob:
    token = logprob_token_text(tokenizer, e.sampled.token_id, e.sampled.decoded)
    top = [TopLogprob(token=(t_text := logprob_token_text(tokenizer, t.token_id, t.decoded)), logprob=t.logprob,
                      bytes=list(t_text.encode()))
           for t in e.top]
    return TokenLogprob(token=token, logprob=e.sampled.logprob, bytes=list(token.encode()), top_logprobs=top)
