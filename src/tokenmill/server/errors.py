"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every client mistake becomes an `OpenAIError` with a 4xx status; the handlers installed by
`install_error_handlers` turn FastAPI's and Starlette's own errors (validation, 404, 405) into the same
shape, and anything unexpected into a 500 that names the exception without a traceback.
"""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.server.protocol import INVALID_UNICODE, ErrorInfo, ErrorResponse

logger = logging.getLogger("tokenmill.server")

_STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 503: "server_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = _utf8(message), _utf8(param)   # an error about bad text must not fail on it itself
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _utf8(text: str | None) -> str | None:
    """text with anything UTF-8 cannot encode (lone surrogates) written as escapes."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


_PARAM_IN_MESSAGE = re.compile(r"sampling parameter (\w+)=|^(\w+) \(")   # "... top_p=0" | "min_tokens (9) ..."


def from_value_error(e: ValueError) -> OpenAIError:
    """A ValueError from SamplingParams or the engine: its message names the field at fault."""
    message = str(e)
    m = _PARAM_IN_MESSAGE.search(message)
    return bad_request(message, param=(m.group(1) or m.group(2)) if m else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _on_openai_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)


async def _on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_error(exc.errors())
    content_type = request.headers.get("content-type", "")
    if err.param is None and content_type and "json" not in content_type:
        err = bad_request(f"request body must be JSON sent with 'Content-Type: application/json', "
                          f"got Content-Type {content_type!r}")
    return err.response()


def validation_error(errors) -> OpenAIError:
    """The first pydantic/FastAPI error, as a 400 naming the field."""
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    if err.get("type") == INVALID_UNICODE:
        return bad_request(err.get("msg"), param=(err.get("ctx") or {}).get("param"), code="invalid_unicode")
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"request body is not valid JSON: {detail}".rstrip(": "), code="json_invalid")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Union members appear in loc as type names ("str", "list[int]"); keep only the field path.
    path = [p for p in loc if not _is_type_name(p)]
    param = ".".join(path) or None
    if err.get("type") == "missing" and param is None:
        return bad_request("request body is required (a JSON object)")
    if err.get("type") == "missing":
        return bad_request(f"missing required field '{param}'", param=param, code="missing_field")
    if param is None:
        return bad_request(f"request body must be a JSON object: {err.get('msg')}")
    got = err.get("input")
    return bad_request(f"invalid value for '{param}': {err.get('msg')} (got {_short(got)})", param=param)


def _is_type_name(p: str) -> bool:
    return p in {"str", "int", "float", "bool", "dict", "list"} or "[" in p or p.startswith("function-")


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
        return OpenAIError(404, message, code="not_found").response()
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        return OpenAIError(405, message, code="method_not_allowed").response()
    if exc.status_code == 413:
        return OpenAIError(413, str(exc.detail), code="request_too_large").response()
    return OpenAIError(exc.status_code, str(exc.detail)).response()


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    message = f"internal server error: {type(exc).__name__}: {exc}"
    return OpenAIError(500, message, type="server_error").response()
