"""`LLM`: the offline Python API. `LLM().generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import numbers
from typing import Iterator, Sequence

from tokenmill.config import EngineArgs
from tokenmill.engine.errors import RequestFailedError, RequestUnavailableError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Prompt = str | list[int] | dict     # dict: vLLM's {"prompt": str} or {"prompt_token_ids": [...]}
Message = dict
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


class LLM:
    """Loads a model (None: the default SmolLM2-135M-Instruct GGUF) and generates with continuous batching.
    Keyword arguments are EngineArgs fields (max_num_seqs, enable_prefix_caching, block_size, ...);
    config=FILE reads them from a config file (as `tokenmill tune` writes), the keyword arguments on top."""

    def __init__(self, model: str | None = None, config: str | None = None, **engine_args) -> None:
        if model is not None:
            engine_args["model"] = model
        args = EngineArgs.from_file(config, **engine_args) if config else EngineArgs(**engine_args)
        self.engine = LLMEngine(args)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallel) and replicas (data parallel); the LLM is
        unusable afterwards. An LLM dropped without it stops its data-parallel replicas when it is
        garbage-collected (engine/replicas.py)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Outputs in prompt order. A single prompt may be a string or one list of token ids.
        A bad prompt or parameter raises ValueError/TypeError and leaves none of the batch queued; a
        request that fails in the engine raises RequestFailedError naming its prompt, and the rest of the
        batch is aborted. Either way the engine stays usable."""
        prompts = _as_prompt_list(prompts)
        texts = [p.get("prompt") if isinstance(p, dict) else None for p in prompts]
        prompts = [_engine_prompt(p) for p in prompts]
        params = _as_params_list(sampling_params, len(prompts))
        ids: dict[str, int] = {}                 # request id -> prompt index
        done: dict[str, RequestOutput] = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                ids[self._add(p, sp)] = i
            while len(done) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        _raise_if_failed(out, f"prompt {ids[out.request_id]}")
                        done[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        outs = [done[rid] for rid in ids]
        for out, text in zip(outs, texts):     # token-id prompts given with their text keep it
            if out.prompt is None and isinstance(text, str):
                out.prompt = text
        return outs

    def _add(self, prompt: Prompt, params: SamplingParams, stream: bool = False) -> str:
        rid = str(next(self._ids))
        self.engine.add_request(rid, prompt, params, stream=stream)
        return rid

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield cumulative outputs of one request as tokens arrive (`.outputs[i].new_text` is the delta)."""
        rid = self._add(_engine_prompt(prompt), sampling_params or SamplingParams(), stream=True)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        _raise_if_failed(out)
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or several; uses the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for c in convs:
            text, ids = _render_chat(self.tokenizer, c, add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": ids})   # prompt: the rendered text, as vLLM's
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt)


def apply_chat_template(tokenizer, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation through the model's chat template; a clear error without one."""
    return _render_chat(tokenizer, messages, add_generation_prompt)[1]


def _render_chat(tokenizer, messages: list[Message], add_generation_prompt: bool) -> tuple[str, list[int]]:
    """(text, token ids) of a conversation through the model's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {m!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _raise_if_failed(out: RequestOutput, which: str | None = None) -> None:
    if out.error is not None:
        kind = RequestUnavailableError if out.error_unavailable else RequestFailedError
        raise kind(f"{which}: {out.error}" if which else out.error)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_token_id(t) for t in prompts):
        return [_token_ids(prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got "
                        f"{type(prompts).__name__}")
    return [_token_ids(p) if isinstance(p, (list, tuple)) else p for p in prompts]


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and type(t).__name__ not in ("bool", "bool_")


def _token_ids(ids) -> list:
    """A token-id prompt as a list, numpy (or other integral) ids as int; anything else left for the
    engine to reject."""
    return [int(t) if _is_token_id(t) else t for t in ids]


def _engine_prompt(prompt):
    """A vLLM-style prompt dict as the engine takes it: its token ids if given, else its text."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS), key=str)
    if unknown:
        raise ValueError(f"unsupported prompt keys {unknown}; a prompt dict takes 'prompt' (a string) "
                         f"and/or 'prompt_token_ids' (a list of token ids)")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return _token_ids(ids)
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise TypeError(f"a prompt dict's 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    raise ValueError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list of token ids)")


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return params
