"""GET /v1/models, POST /tokenize, POST /detokenize."""
from __future__ import annotations

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest,
                                       TokenizeResponse)
from tokenmill.server.serving_chat import render_chat
from tokenmill.server.serving_engine import Serving


def list_models(serving: Serving) -> ModelList:
    return ModelList(data=[ModelCard(id=serving.model_name, max_model_len=serving.engine.max_model_len)])


def tokenize(serving: Serving, req: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.prompt is not None:
        ids = serving.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = render_chat(serving, req.messages, req.add_generation_prompt)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=serving.engine.max_model_len)


def detokenize(serving: Serving, req: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(req.model)
    serving.check_token_ids(req.tokens, "tokens")
    return DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens))
