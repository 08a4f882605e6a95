"""An endpoint plugin: completion responses that carry each token's temperature and entropy.

Enabled with `VLLM_PLUGINS=entropic` (vLLM loads endpoint plugins only when named there).
It replaces POST /v1/completions and /v1/chat/completions by wrappers around vLLM's own
handlers. A request whose `vllm_xargs` turns the thermostat on, non-streaming and with n=1,
gets a trace key added to its `vllm_xargs`; after vLLM's handler returns, the wrapper fetches
the trace from the worker (one `collective_rpc`, see `entropic_vllm.traces`) and adds to the
choice

    "entropic": {"temperatures": [...], "entropies": [...], "controlled_entropies": [...]}

(per output token: the temperature it was sampled at, the model's temperature-1 entropy and
the entropy the controller read, in nats). Every other request passes through untouched.
Streaming responses and n > 1 carry no trace (a stream's chunks are already sent when the
trace is complete; n > 1 requests share their extra_args, so their traces would collide).
"""
from __future__ import annotations

import json
import logging
import uuid
from argparse import Namespace
from typing import Any, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import validate_json_request

from entropic_vllm.params import PREFIX, TRACE_KEY
from entropic_vllm.traces import EXTENSION, METHOD, fetch_traces_async

log = logging.getLogger(__name__)
PATHS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def _wants_trace(xargs: dict | None) -> bool:
    return bool(xargs) and any(k == "thermostat" or k.startswith(PREFIX) for k in xargs)


class EntropicEndpoint:
    """The `vllm.endpoint_plugins` entry point (a zero-argument factory)."""

    name = "entropic"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.engine_client: Any = None

    def attach_router(self, app: FastAPI) -> None:
        for path, model in PATHS.items():
            original = next((r.endpoint for r in app.routes if isinstance(r, APIRoute)
                             and r.path == path and "POST" in r.methods), None)
            if original is None:
                log.warning("entropic: no POST %s to wrap; its responses carry no trace", path)
                continue
            app.add_api_route(path, self._wrap(original, model), methods=["POST"],
                              dependencies=[Depends(validate_json_request)])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        self.engine_client = engine_client
        if engine_client is None:
            return
        try:
            await engine_client.collective_rpc(METHOD, args=([],))
        except Exception as e:  # the worker lacks the method: say how to add it
            raise RuntimeError(f"entropic endpoint plugin: the workers have no {METHOD}; "
                               f"start vLLM with --worker-extension-cls {EXTENSION}") from e

    def _wrap(self, original: Callable[..., Awaitable[Any]], model: type) -> Callable:
        plugin = self

        async def endpoint(request, raw_request):
            xargs = request.vllm_xargs
            if (not _wants_trace(xargs) or request.stream or (getattr(request, "n", 1) or 1) != 1
                    or plugin.engine_client is None):
                return await original(request, raw_request)
            key = f"entropic-{uuid.uuid4().hex}"
            request.vllm_xargs = {**xargs, TRACE_KEY: key}
            try:
                response = await original(request, raw_request)
            finally:  # fetch even after an error: the trace is dropped either way
                traces = await fetch_traces_async(plugin.engine_client, [key])
            if not isinstance(response, JSONResponse) or response.status_code != 200:
                return response
            body = json.loads(response.body)
            if key in traces and len(body.get("choices", ())) == 1:
                body["choices"][0]["entropic"] = traces[key]
            headers = {k: v for k, v in response.headers.items()
                       if k.lower() not in ("content-length", "content-type")}
            return JSONResponse(body, headers=headers)

        # FastAPI reads the body's model from the annotation: give it the class itself
        endpoint.__annotations__ = {"request": model, "raw_request": Request}
        endpoint.__name__ = f"entropic_{original.__name__}"
        return endpoint
