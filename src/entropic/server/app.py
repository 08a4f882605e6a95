"""The FastAPI app: OpenAI routes, /v1/models, /health, /metrics, /tokenize, /detokenize.

`build_app(llm, ...)` wires an `LLM` (model, tokenizer, engine with its entropic hooks)
to an AsyncEngine and the Prometheus metrics. The engine thread starts and stops with the
app's lifespan.
"""
from __future__ import annotations

import contextlib
import os
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from entropic.server.async_engine import AsyncEngine
from entropic.server.errors import ApiKeyGate, install_error_handlers
from entropic.server.metrics import ServerMetrics
from entropic.server.openai_api import ServerState, router
from entropic.server.tokenizer_api import router as tokenizer_router
from entropic.server.responses import TokenText


def default_model_name(source: str) -> str:
    """The name clients pass as `model`: the checkpoint's file or directory name."""
    return os.path.basename(os.path.normpath(source)) or "entropic"


def build_app(llm, model_name: str | None = None, api_key: str | None = None,
              max_waiting: int = 256) -> FastAPI:
    """An app serving `llm` (an entropic.LLM). `api_key` guards /v1, /tokenize and
    /detokenize; `max_waiting` bounds the requests held beyond the running batch (429)."""
    name = model_name or default_model_name(llm.source)
    metrics = ServerMetrics(name, llm.engine)
    engine = AsyncEngine(llm.engine, max_waiting, on_step=metrics.on_step)
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

    app = FastAPI(title="entropic", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.entropic = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tokenizer_router)
    if api_key:
        app.add_middleware(ApiKeyGate, api_key=api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness plus the load and KV numbers a probe (or a test) wants."""
        snap = engine.snapshot
        body = {"status": "ok" if engine.alive else "engine_failed", "model": name,
                "requests_in_flight": engine.num_in_flight, "requests_running": snap.running,
                "requests_waiting": snap.waiting, "kv_blocks_used": snap.kv_blocks_used,
                "kv_blocks_total": snap.kv_blocks_total, "kv_cache_usage": snap.kv_usage}
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
