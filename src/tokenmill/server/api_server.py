"""FastAPI app: routes only. Logic lives in serving_*.py; launcher.py runs the app under uvicorn.

Authentication (when an API key is set) covers /v1/*, /tokenize and /detokenize; /health, /version and
/metrics stay open for probes and scrapers.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import OpenAIError, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.middleware import RequestGuard
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.serving_engine import Admission, Serving, in_thread
from tokenmill.server.serving_tokenize import detokenize, list_models, tokenize
from tokenmill.server.streaming import until_disconnect

router = APIRouter()


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _json(model) -> Response:
    if isinstance(model, Response):
        return model
    return Response(content=model.model_dump_json(), media_type="application/json")


@router.get("/health")
async def health(request: Request) -> Response:
    """200 only while the engine can serve: 503 once its loop has stopped, and while draining."""
    try:
        _serving(request).check_accepting()
    except OpenAIError as e:
        return e.response()
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def get_version() -> JSONResponse:
    try:
        v = version("tokenmill")
    except PackageNotFoundError:
        v = "unknown"
    return JSONResponse({"version": v})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(content=_serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return _json(list_models(_serving(request)))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    work = create_completion(_serving(request), body)
    return _json(await (work if body.stream else until_disconnect(request, work)))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    work = create_chat_completion(_serving(request), body)
    return _json(await (work if body.stream else until_disconnect(request, work)))


@router.post("/tokenize")
async def tokenize_route(body: TokenizeRequest, request: Request) -> Response:
    return _json(await in_thread(tokenize, _serving(request), body))


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
    return _json(detokenize(_serving(request), body))


def build_app(engine, config: ServerConfig, max_num_seqs: int) -> FastAPI:
    """One app per engine; its metrics live in the app's own registry."""
    app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None, openapi_url=None,
                  strict_content_type=False,   # a JSON body without a Content-Type is still JSON
                  redirect_slashes=False)      # /v1/completions/ is a 404, not a 307 clients do not follow
    metrics_ = ServerMetrics(engine, engine.model_name, config.metrics_prefix)
    app.state.serving = Serving(engine=engine, config=config, metrics=metrics_,
                                admission=Admission(engine, max_num_seqs, config))
    app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes)
    return app
