"""The FastAPI app: OpenAI routes, /v1/models, /health, /metrics, /tokenize, /detokenize,
/tokenizer_info.

`build_app(llm, ...)` wires an `LLM` (model, tokenizer, engine with its entropic hooks)
to an AsyncEngine and the Prometheus metrics. The engine thread starts and stops with the
app's lifespan.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from entropic.server.async_engine import AsyncEngine, FatalHook
from entropic.server.errors import (ApiKeyGate, BodyLimit, ContainErrors, HostCheck,
                                    install_error_handlers)
from entropic.server.lens import lens_router
from entropic.server.metrics import ServerMetrics
from entropic.server.openai_api import ServerState, router
from entropic.server.tokenizer_api import router as tokenizer_router
from entropic.server.responses import TokenText


def default_model_name(source: str) -> str:
    """The name clients pass as `model`: the checkpoint's file or directory name."""
    return os.path.basename(os.path.normpath(source)) or "entropic"


@dataclass(frozen=True)
class ServerOptions:
    """What `entropic serve` configures beyond the engine; validated once.

    `api_key`: guards /v1, /tokenize, /detokenize (and /tokenizer_info), plus /metrics and
    /health when `protect_metrics`, and /docs and /openapi.json when `enable_docs` (off by
    default: the schema is a map of the API for anyone who can reach the port).
    `max_waiting`: requests held beyond the running batch before 429.
    `max_body_bytes`: larger request bodies get 413; None sizes it to the context,
    `BODY_BYTES_PER_TOKEN` per token of max_model_len, at least `MIN_BODY_BYTES`.
    `allowed_hosts`: names accepted in the Host header (400 otherwise); `entropic serve`
    sets the loopback names when it binds a loopback address (see `default_allowed_hosts`).
    `ui`: serve the entropy lens page at / (server/lens.py); its static files need no key,
    the API calls it makes do."""

    model_name: str | None = None
    api_key: str | None = None
    max_waiting: int = 256
    max_body_bytes: int | None = None
    protect_metrics: bool = False
    enable_docs: bool = False
    allowed_hosts: frozenset[str] | None = None  # Host header names served; None: any
    ui: bool = True

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key: must not be empty (omit it to serve without a key)")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting: must be >= 0, got {self.max_waiting}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: must be at least 1024, got {self.max_body_bytes}")
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protect_metrics: needs an API key to protect them with")

    def body_limit(self, max_model_len: int) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)

    def guarded_prefixes(self) -> tuple[str, ...]:
        paths = ["/v1", "/tokenize", "/detokenize"]
        if self.protect_metrics:
            paths += ["/metrics", "/health"]
        if self.enable_docs:
            paths += ["/docs", "/openapi.json"]
        return tuple(paths)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def default_allowed_hosts(bind_host: str) -> frozenset[str] | None:
    """The loopback names when the server binds a loopback address, else None (any Host:
    a server on the network is reached under names it cannot know)."""
    if bind_host in ("localhost", "::1") or bind_host.startswith("127."):
        return LOOPBACK_NAMES | {bind_host if ":" not in bind_host else f"[{bind_host}]"}
    return None


# A token is ~4 characters of text, and JSON may spend up to 6 bytes on one (an escape), or
# ~7 on a token id in a list: 128 bytes per token of context leaves room for any request
# that could fit the context, chat framing included.
BODY_BYTES_PER_TOKEN = 128
MIN_BODY_BYTES = 1 << 20


def build_app(llm, options: ServerOptions = ServerOptions(),
              on_fatal: FatalHook | None = None) -> FastAPI:
    """An app serving `llm` (an entropic.LLM). `on_fatal` is called (on the engine thread)
    if the engine loop dies; /health reports it from then on."""
    name = options.model_name or default_model_name(llm.source)
    metrics = ServerMetrics(name, llm.engine)
    engine = AsyncEngine(llm.engine, options.max_waiting, on_step=metrics.on_step,
                         on_fatal=on_fatal)
    state = ServerState(engine, llm.tokenizer, name, TokenText(llm.tokenizer),
                        llm.engine.max_model_len)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    docs = options.enable_docs
    app = FastAPI(title="entropic", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    app.state.entropic = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tokenizer_router)
    if options.ui:
        app.include_router(lens_router())
    # added innermost first: the key is checked before the body is read
    app.add_middleware(ContainErrors)
    app.add_middleware(BodyLimit, max_bytes=options.body_limit(llm.engine.max_model_len))
    if options.api_key is not None:
        app.add_middleware(ApiKeyGate, api_key=options.api_key,
                           prefixes=options.guarded_prefixes())
    if options.allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=options.allowed_hosts)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness plus the load and KV numbers a probe (or a test) wants."""
        snap, stats = engine.snapshot, llm.engine.stats
        body = {"status": "ok" if engine.alive else "engine_failed", "model": name,
                "error": None if engine.error is None else
                f"{type(engine.error).__name__}: {engine.error}",
                "requests_in_flight": engine.num_in_flight, "requests_running": snap.running,
                "requests_waiting": snap.waiting, "kv_blocks_used": snap.kv_blocks_used,
                "kv_blocks_total": snap.kv_blocks_total, "kv_cache_usage": snap.kv_usage,
                "dtype": stats.dtype, "dtype_reason": stats.dtype_reason, "isa": stats.isa,
                "quantization": stats.quantization,
                "quantization_reason": stats.quantization_reason}
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(engine.snapshot, engine.num_in_flight),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "entropic",
            "max_model_len": llm.engine.max_model_len}]}

    return app
