"""OpenAI-style errors: one body shape for every failure, and the API-key gate.

Every error the server returns is `{"error": {"message", "type", "param", "code"}}`:
FastAPI's own 422 for a bad body becomes a 400 in that shape, and so do unknown routes,
engine validation errors (ValueError/TypeError naming the field and its limit), a full
queue (429) and a missing or wrong API key (401).
"""
from __future__ import annotations

import hmac
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from entropic.server.async_engine import EngineDeadError, QueueFullError
from entropic.server.protocol import error_body

log = logging.getLogger("entropic.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error"}


class ApiError(Exception):
    """An error to return as is: HTTP status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status)


def bad_request(e: Exception) -> ApiError:
    """A ValueError/TypeError from SamplingParams or LLMEngine.validate as a 400. Their
    messages start with the field's name ("max_tokens: prompt (...) exceeds ..."), which
    becomes `param`."""
    msg = str(e)
    m = re.match(r"[A-Za-z_][\w.]*", msg)
    param = m.group(0) if m else None
    return ApiError(400, msg, param=param)


def _describe(err: dict) -> tuple[str, str | None]:
    """Message and param of pydantic's first complaint."""
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if not loc:
        return "request body: a JSON object is required", None
    param = loc[0]
    got = err.get("input")
    shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
    where = ".".join(loc)
    if err.get("type") == "missing":
        return f"{where}: field required", param
    return f"{where}: {err.get('msg')} (got {shown})", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        msg, param = _describe(errors[0]) if errors else ("invalid request", None)
        return ApiError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, exc: QueueFullError):
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.rejected.labels(reason="queue_full").inc()
        return ApiError(429, str(exc), code="queue_full").response()

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return ApiError(503, str(exc)).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()


class ApiKeyGate:
    """ASGI middleware: paths under `prefixes` need `Authorization: Bearer <key>` (401
    otherwise). /health and /metrics stay open for probes and scrapers. Plain ASGI rather
    than BaseHTTPMiddleware, which would get in the way of streamed responses."""

    def __init__(self, app, api_key: str,
                 prefixes: tuple[str, ...] = ("/v1", "/tokenize", "/detokenize")) -> None:
        self.app = app
        self._key = api_key.encode()
        self.prefixes = prefixes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                why = "missing" if not auth else "invalid"
                resp = JSONResponse(
                    error_body(f"{why} API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", None, "invalid_api_key"),
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
