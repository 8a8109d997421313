"""OpenAI-compatible request and response bodies (pydantic).

Requests are strict about types (`"max_tokens": "5"` or `true` is a 400, not coerced) and ignore unknown
fields, as the OpenAI API does; a null where OpenAI allows one means the field's default. Every string
anywhere in a body must be valid Unicode (a JSON escape of a lone surrogate such as "\\ud800" is not): else
a 400 naming where it is. Value ranges are checked by `Serving.sampling_params` (OpenAI's ranges) and
`SamplingParams` (what the engine computes); the server adds its own limits (n, logprobs, context window).
"""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

INVALID_UNICODE = "invalid_unicode"   # the pydantic error type for a string that is not valid Unicode


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    # Fields OpenAI types as "... or null" whose default is not None: a null there means the default, as
    # vLLM reads them (the other fields OpenAI lets be null default to None).
    null_means_default: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data):
        if not cls.null_means_default or not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.null_means_default}


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
    Iterative: a body nested as deeply as the JSON parser allows must not exhaust the stack here. It runs
    on the event loop, so its work stays small per element: a number, bool or null costs two type tests
    and leaves nothing allocated, an ASCII string an O(1) test; only dicts and lists are stacked, and a
    path is spelled out only for the string at fault."""
    if isinstance(value, str):
        return None if _encodable(value) else ()
    stack = [_Container(value, None, "")] if isinstance(value, (dict, list)) else []
    while stack:
        container = stack.pop()
        entries = container.value.items() if isinstance(container.value, dict) else enumerate(container.value)
        for key, item in entries:
            if type(key) is str and not _encodable(key):
                return _path(container, key)
            kind = type(item)
            if kind is str:
                if not _encodable(item):
                    return _path(container, key)
            elif kind is dict or kind is list:
                stack.append(_Container(item, container, key))
    return None


class _Container(NamedTuple):
    """A dict or list met in the walk, with where it sits: `key` (a dict key or list index) in `parent`."""
    value: dict | list
    parent: "_Container | None"
    key: str | int


def _path(container: _Container, key: str | int) -> tuple[str, ...]:
    """The path of `key` inside `container`, from the root; keys written so that they encode as UTF-8."""
    parts = [key]
    while container.parent is not None:
        parts.append(container.key)
        container = container.parent
    return tuple(str(part).encode("utf-8", "backslashreplace").decode("utf-8") for part in reversed(parts))


def _encodable(text: str) -> bool:
    if text.isascii():      # O(1): CPython records it
        return True
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
    null_means_default = frozenset({"include_usage"})
    include_usage: bool = False


class SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus vLLM's extras)."""
    null_means_default = frozenset({"n", "stream", "echo", "logprobs"})   # echo: completions only
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
