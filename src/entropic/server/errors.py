"""OpenAI-style errors: one body shape for every failure, and the ASGI guards.

Every error the server returns is `{"error": {"message", "type", "param", "code"}}`:
FastAPI's own 422 for a bad body becomes a 400 in that shape, and so do unknown routes,
engine validation errors (ValueError/TypeError naming the field and its limit), a full
queue (429, with Retry-After), a body over the size limit (413), a missing or wrong API key
(401), a request the engine failed alone (500) and any other exception in a handler (500).
None of them closes the connection: the response completes and keep-alive goes on.
"""
from __future__ import annotations

import hmac
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from entropic.server.async_engine import EngineDeadError, QueueFullError, RequestFailedError
from entropic.server.protocol import error_body

log = logging.getLogger("entropic.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}
RETRY_AFTER_S = 1  # what a 429 tells the client to wait: requests here last seconds


class ApiError(Exception):
    """An error to return as is: HTTP status, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status, headers=self.headers)


def bad_request(e: Exception) -> ApiError:
    """A ValueError/TypeError from SamplingParams or LLMEngine.validate as a 400. Their
    messages start with the field's name ("max_tokens: prompt (...) exceeds ..."), which
    becomes `param`."""
    msg = str(e)
    m = re.match(r"[A-Za-z_][\w.]*", msg)
    param = m.group(0) if m else None
    return ApiError(400, msg, param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe(err: dict) -> tuple[str, str | None]:
    """Message and param of pydantic's first complaint."""
    # pydantic names the member of a union it tried ("str", "function-after[...]"): not a
    # field, so not shown
    loc = [str(x) for x in err.get("loc", ()) if x != "body"
           and not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
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
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    return f"{where}: {msg} (got {shown})", param


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
        if isinstance(exc, BodyTooLarge):
            return exc.error().response()
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, exc: QueueFullError):
        metrics = getattr(request.app.state, "metrics", None)
        if metrics is not None:
            metrics.rejected.labels(reason="queue_full").inc()
        return ApiError(429, str(exc), code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return ApiError(503, str(exc)).response()

    @app.exception_handler(RequestFailedError)
    async def _failed(request: Request, exc: RequestFailedError):
        return ApiError(500, str(exc), code="request_failed").response()


class ContainErrors:
    """ASGI middleware: an exception that escapes a handler becomes a JSON 500 and the
    response completes, so the connection stays usable. (Starlette's own 500 handler
    re-raises to the server, which then drops the connection: a keep-alive client's next
    request would be reset.) Once a response has started it can only be cut short."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception("unhandled error on %s", scope.get("path"))
            if not started:
                await ApiError(500, f"internal error: {type(exc).__name__}: {exc}"
                               ).response()(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    """A request body passed the size limit while being read. An HTTPException, so that
    FastAPI's body parsing lets it through (it turns other errors into a 400)."""

    def __init__(self, max_bytes: int, got: str) -> None:
        super().__init__(413, f"request body: {got} exceeds the limit of {max_bytes} bytes "
                              f"(the server's --max-body-bytes)")

    def error(self) -> ApiError:
        return ApiError(413, str(self.detail), code="body_too_large")


class BodyLimit:
    """ASGI middleware: request bodies over `max_bytes` get a 413 (from Content-Length at
    once, or as soon as a chunked body passes the limit), before anything parses them."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            too_large = BodyTooLarge(self.max_bytes, f"{int(length)} bytes")
            return await too_large.error().response()(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes, f"more than {self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)


class ApiKeyGate:
    """ASGI middleware: paths starting with one of `prefixes` need
    `Authorization: Bearer <key>` (401 otherwise). Plain ASGI rather than
    BaseHTTPMiddleware, which would get in the way of streamed responses."""

    def __init__(self, app, api_key: str, prefixes: tuple[str, ...]) -> None:
        if not api_key:
            raise ValueError("api_key: must not be empty")
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


class HostCheck:
    """ASGI middleware: requests whose Host header (port aside) is not in `allowed` get a
    400. A server on loopback allows only loopback names, which defeats DNS rebinding (a
    hostile page whose domain re-resolves to 127.0.0.1 sends its own name as Host)."""

    def __init__(self, app, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.allowed:
                resp = ApiError(400, f"Host header {host!r} is not served here (allowed: "
                                     f"{', '.join(sorted(self.allowed))}; see --allowed-hosts)",
                                param=None, code="invalid_host").response()
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)
