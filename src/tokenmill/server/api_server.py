"""FastAPI app: routes only. Logic lives in serving_*.py; `run_server` runs it under uvicorn.

Authentication (when an API key is set) covers /v1/*, /tokenize and /detokenize; /health, /version and
/metrics stay open for probes and scrapers.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.server.config import ServerConfig
from tokenmill.server.errors import OpenAIError, install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest)
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.serving_engine import Admission, Serving
from tokenmill.server.serving_tokenize import detokenize, list_models, tokenize
from tokenmill.server.streaming import until_disconnect

logger = logging.getLogger("tokenmill.server")
router = APIRouter()
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_ABORT_SLACK_S = 5.0   # after the grace time and the aborts, uvicorn cancels whatever is still running


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _json(model) -> Response:
    if isinstance(model, Response):
        return model
    return Response(content=model.model_dump_json(), media_type="application/json")


@router.get("/health")
async def health(request: Request) -> Response:
    if _serving(request).draining:
        return OpenAIError(503, "server is shutting down", code="shutting_down").response()
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
    return _json(tokenize(_serving(request), body))


@router.post("/detokenize")
async def detokenize_route(body: DetokenizeRequest, request: Request) -> Response:
    return _json(detokenize(_serving(request), body))


def build_app(engine, config: ServerConfig, max_num_seqs: int) -> FastAPI:
    """One app per engine; its metrics live in the app's own registry."""
    app = FastAPI(title="tokenmill", docs_url=None, redoc_url=None, openapi_url=None,
                  strict_content_type=False)   # a JSON body without a Content-Type is still JSON
    metrics_ = ServerMetrics(engine, engine.model_name)
    app.state.serving = Serving(engine=engine, config=config, metrics=metrics_,
                                admission=Admission(engine, max_num_seqs, config))
    app.include_router(router)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes)
    return app


class RequestGuard:
    """ASGI middleware: API key (401) first, then body size (413), before any parsing."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith(PROTECTED_PREFIXES):
            if not self._authorized(headers.get("authorization", "")):
                err = OpenAIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                                  code="invalid_api_key")
                return await err.response()(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(int(length)).response()(scope, receive, send)
        await self.app(scope, self._limited(receive), send)

    def _authorized(self, header: str) -> bool:
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self, size: int | None) -> OpenAIError:
        got = f"{size} bytes" if size is not None else "more"
        return OpenAIError(413, f"request body is too large: {got}, limit {self.max_body_bytes} bytes",
                           code="request_too_large")

    def _limited(self, receive):
        received = 0

        async def wrapped():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large(None).message)
            return message
        return wrapped


class _Server(uvicorn.Server):
    """uvicorn plus a drain: the first SIGTERM/SIGINT marks the app as draining (/health 503, new work 503)
    while uvicorn stops accepting connections; in-flight requests may finish for `shutdown_grace_s`, then
    are aborted, so their responses still end properly (finish_reason "abort", `data: [DONE]`)."""

    def __init__(self, config: uvicorn.Config, serving: Serving) -> None:
        super().__init__(config)
        self.serving = serving
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if not self.serving.draining and self.loop is not None:
            grace_s = self.serving.config.shutdown_grace_s
            logger.info("signal %s: draining, %.1f s for in-flight requests", sig, grace_s)
            self.loop.call_soon_threadsafe(self.loop.call_later, grace_s, self._abort_in_flight)
        self.serving.draining = True
        super().handle_exit(sig, frame)

    def _abort_in_flight(self) -> None:
        if self.serving.live_calls:
            logger.warning("grace time over: aborting %d in-flight requests", len(self.serving.live_calls))
        asyncio.ensure_future(self.serving.abort_all())


@contextmanager
def _exit_cleanly_on_signals():
    """uvicorn re-raises the signal it caught after shutting down; make that a no-op so we exit with 0."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(engine, config: ServerConfig, max_num_seqs: int) -> int:
    """Serve until SIGTERM/SIGINT; in-flight requests get `shutdown_grace_s`, then are aborted. Returns 0."""
    app = build_app(engine, config, max_num_seqs)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               access_log=False, timeout_graceful_shutdown=config.shutdown_grace_s + _ABORT_SLACK_S,
                               lifespan="off", ws="none")
    server = _Server(uv_config, app.state.serving)
    logger.info("serving %s on http://%s:%d", engine.model_name, config.host, config.port)
    try:
        with _exit_cleanly_on_signals():
            server.run()
    finally:
        engine.shutdown()
    return 0 if server.started else 1
