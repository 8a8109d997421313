"""OpenAI-compatible request and response bodies (pydantic).

Requests are strict about types (`"max_tokens": "5"` or `true` is a 400, not coerced) and ignore unknown
fields, as the OpenAI API does. Every string anywhere in a body must be valid Unicode (a JSON escape of a
lone surrogate such as "\\ud800" is not): else a 400 naming where it is. Value ranges are checked by
`Serving.sampling_params` (OpenAI's ranges) and `SamplingParams` (what the engine computes); the server
adds its own limits (n, logprobs, context window).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

INVALID_UNICODE = "invalid_unicode"   # the pydantic error type for a string that is not valid Unicode


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Body(_Request):
    """A whole request body: its strings (values and keys, however deeply nested) are checked before the
    fields are, so the error names the full path."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        path = invalid_unicode_path(data)
        if path is not None:
            where = ".".join(part or '""' for part in path) or "body"
            raise PydanticCustomError(INVALID_UNICODE, "'{param}' is not valid Unicode text (it holds a lone "
                                      "surrogate such as \\ud800); send UTF-8 text", {"param": where})
        return data


def invalid_unicode_path(value) -> tuple[str, ...] | None:
    """The path to a string (or dict key) in a parsed JSON value that cannot be encoded as UTF-8, or None.
    Iterative: a body nested as deeply as the JSON parser allows must not exhaust the stack here."""
    stack: list[tuple[tuple[str, ...], object]] = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            for key, sub in item.items():
                key_path = path + (str(key).encode("utf-8", "backslashreplace").decode("utf-8"),)
                if not _encodable(str(key)):
                    return key_path
                stack.append((key_path, sub))
        elif isinstance(item, list):
            stack.extend((path + (str(i),), sub) for i, sub in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------------------------- errors
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# --------------------------------------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None   # accepted only when empty
    ttft_target_ms: float | None = None          # latency targets (default: the server's SLO class)
    tpot_target_ms: float | None = None
    user: str | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None                   # accepted only when equal to n
    suffix: str | None = None                    # accepted only when empty


class TextPart(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")   # tool_calls etc. reach the chat template
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None     # accepted only when empty
    response_format: dict[str, Any] | None = None  # accepted only as {"type": "text"}


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# -------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler):   # deltas carry only what changed, as OpenAI's do
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str
