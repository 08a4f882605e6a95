"""/v1/completions and /v1/chat/completions: request -> engine stream -> JSON or SSE.

Streaming sends one chunk per generated token (the first one also carries the chat role,
so a client's time to first chunk is its time to first token), then `data: [DONE]`.
A client that disconnects aborts its request: for streams Starlette cancels the response
task, which cancels the wait on the engine stream; non-streamed requests poll
`is_disconnected()` while they wait.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from entropic.outputs import RequestOutput
from entropic.sampling_params import SamplingParams
from entropic.server.async_engine import AsyncEngine, RequestStream
from entropic.server.errors import ApiError, bad_request
from entropic.server.protocol import (ChatCompletionRequest, CompletionRequest, _SamplingFields,
                                      error_body)
from entropic.server.responses import (TokenText, chat_logprob_entries, completion_logprobs,
                                       entropic_block, usage)

DISCONNECT_POLL_S = 0.5
log = logging.getLogger("entropic.server")

router = APIRouter()


@dataclass
class ServerState:
    """What the handlers share; built once by the app factory."""

    engine: AsyncEngine
    tokenizer: object
    model_name: str
    text: TokenText
    max_model_len: int

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model: {name!r} is not served here; this server serves "
                                f"{self.model_name!r} (see /v1/models)", param="model",
                           code="model_not_found")


def _state(request: Request) -> ServerState:
    return request.app.state.entropic


def _check_common(state: ServerState, body: _SamplingFields) -> None:
    state.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise ApiError(400, bad[1], param=bad[0])


async def _build(state: ServerState, prompt, make_params: Callable[[], SamplingParams]
                 ) -> tuple[list[int], SamplingParams]:
    """SamplingParams and the engine's own validation (which tokenizes a text prompt); their
    errors become 400s. In a worker thread: a long prompt takes the tokenizer a while, and
    the event loop serves every other client's stream meanwhile."""
    def build():
        params = make_params()
        return state.engine.validate(prompt, params), params

    try:
        return await run_in_threadpool(build)
    except (ValueError, TypeError) as e:
        raise bad_request(e) from None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A streamed response that always closes its body iterator, whatever ends the stream
    (end of output, client gone, error), so the request is released at once."""

    async def stream_response(self, send) -> None:
        async with contextlib.aclosing(self.body_iterator):
            await super().stream_response(send)


def _sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return _SSEResponse(chunks, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _final(stream: RequestStream, request: Request) -> RequestOutput | None:
    """The request's last output; None (request aborted) if the client goes away first."""
    async def drain() -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        return last

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()
        stream.close()


async def _guarded(chunks: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """Release the request however the stream ends; report an engine error in-band (the
    status line has already gone out) before the closing [DONE]."""
    try:
        async for c in chunks:
            yield c
    except Exception as e:  # the request failed (or a bug in shaping it): say so in-band
        if not isinstance(e, (ValueError, TypeError, RuntimeError)):
            log.exception("stream of %s failed", stream.request_id)
        bad_input = isinstance(e, (ValueError, TypeError))
        yield _sse(error_body(str(e), "invalid_request_error" if bad_input else "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


async def _respond(job, stream: RequestStream, streaming: bool, request: Request) -> Response:
    """An SSE stream of the job's chunks, or its whole body once the request finishes
    (499 if the client left first)."""
    if streaming:
        return _sse_response(_guarded(job.chunks(stream), stream))
    out = await _final(stream, request)
    if out is None:
        return Response(status_code=499)
    return JSONResponse(job.body(out))


# ---- /v1/completions ------------------------------------------------------------------------
@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    _check_common(state, body)
    try:
        prompt = body.single_prompt()
    except ValueError as e:
        raise ApiError(400, str(e), param="prompt") from None
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens < 0:
        raise ApiError(400, f"max_tokens: must be >= 0, got {max_tokens}", param="max_tokens")
    if max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: must be at least 1 (0 is allowed only with echo=true, "
                            "to score the prompt)", param="max_tokens")
    lp = body.logprobs
    # Scoring only (echo, max_tokens 0): the engine samples one token, which is dropped.
    ids, params = await _build(state, prompt, lambda: body.sampling_params(
        max(max_tokens, 1), lp, prompt_logprobs=lp if body.echo and lp is not None else None))
    rid = f"cmpl-{uuid.uuid4().hex}"
    stream = state.engine.submit(rid, ids, params)
    echo_text = ""
    if body.echo:
        echo_text = prompt if isinstance(prompt, str) else state.tokenizer.decode(
            ids, skip_special_tokens=body.skip_special_tokens)
    job = _Completion(state, body, rid, ids, echo_text, max_tokens == 0)
    return await _respond(job, stream, body.stream, request)


class _Completion:
    """Shapes one completions request's outputs."""

    def __init__(self, state: ServerState, body: CompletionRequest, rid: str, ids: list[int],
                 echo_text: str, score_only: bool) -> None:
        self.s, self.b, self.rid, self.ids = state, body, rid, ids
        self.echo_text, self.score_only = echo_text, score_only
        self.created = int(time.time())
        self.entropy = body.wants_entropy or body.logprobs is not None

    def _prompt_entries(self, out: RequestOutput) -> list:
        pl = out.prompt_logprobs or [None] * len(self.ids)
        return [e if e is not None else (t, None) for t, e in zip(self.ids, pl)]

    def _choice(self, out: RequestOutput, text: str, start: int, offset: int,
                with_prompt: bool, final: bool) -> dict:
        """A choice over output tokens [start:], its text starting at char `offset`."""
        gen = [] if self.score_only else out.logprobs[start:] if out.logprobs else []
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": out.finish_reason if final else None}
        if final:
            choice["stop_reason"] = out.stop_reason
        if self.b.logprobs is not None:
            entries = (self._prompt_entries(out) if with_prompt else []) + gen
            choice["logprobs"] = completion_logprobs(entries, self.s.text, offset)
        if self.entropy:  # scoring only: the one token sampled is dropped, and its reading
            choice["entropic"] = (entropic_block(out, len(out.entropies), False)
                                  if self.score_only else entropic_block(out, start, final))
        return choice

    def body(self, out: RequestOutput) -> dict:
        text = self.echo_text + ("" if self.score_only else out.text)
        n_out = 0 if self.score_only else len(out.token_ids)
        if self.score_only:
            out.finish_reason = "length"
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.s.model_name,
                "choices": [self._choice(out, text, 0, 0, self.b.echo, True)],
                "usage": usage(len(self.ids), n_out)}

    def _chunk(self, choice: dict) -> str:
        return _sse({"id": self.rid, "object": "text_completion", "created": self.created,
                     "model": self.s.model_name, "choices": [choice]})

    async def chunks(self, stream: RequestStream) -> AsyncIterator[str]:
        offset, first, n_out = 0, True, 0
        async for out in stream:
            if self.score_only:
                out.finish_reason = "length"
                yield self._chunk(self._choice(out, self.echo_text, 0, 0, True, True))
                break
            text = (self.echo_text if first else "") + out.text_delta
            start = len(out.token_ids) - len(out.new_token_ids)
            if text or out.finished or self.b.logprobs is not None or self.entropy:
                yield self._chunk(self._choice(out, text, start, offset,
                                               first and self.b.echo, out.finished))
            offset += len(text)
            first = False
            n_out = len(out.token_ids)
        opts = self.b.stream_options
        if opts is not None and opts.include_usage:
            yield _sse({"id": self.rid, "object": "text_completion", "created": self.created,
                        "model": self.s.model_name, "choices": [],
                        "usage": usage(len(self.ids), n_out)})
        yield "data: [DONE]\n\n"


# ---- /v1/chat/completions -------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    _check_common(state, body)
    try:
        ids = await run_in_threadpool(state.tokenizer.apply_chat_template,
                                      [m.as_template_dict() for m in body.messages],
                                      body.add_generation_prompt)
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    eng = state.engine.engine
    max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                  else body.max_tokens)
    if max_tokens is None:  # the rest of the context, within what the KV cache can hold
        room = min(eng.max_model_len, eng.num_blocks * eng.config.block_size) - len(ids)
        max_tokens = max(room, 1)
    lp = (body.top_logprobs or 0) if body.logprobs else None
    ids, params = await _build(state, ids, lambda: body.sampling_params(max_tokens, lp))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.engine.submit(rid, ids, params)
    job = _Chat(state, body, rid, len(ids))
    return await _respond(job, stream, body.stream, request)


class _Chat:
    """Shapes one chat request's outputs."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, rid: str,
                 n_prompt: int) -> None:
        self.s, self.b, self.rid, self.n_prompt = state, body, rid, n_prompt
        self.created = int(time.time())
        self.entropy = body.wants_entropy or body.logprobs

    def _extras(self, choice: dict, out: RequestOutput, start: int, final: bool) -> dict:
        if self.b.logprobs and out.logprobs is not None:
            choice["logprobs"] = {"content": chat_logprob_entries(out.logprobs[start:],
                                                                  self.s.text)}
        if self.entropy:
            choice["entropic"] = entropic_block(out, start, final)
        return choice

    def body(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": None, "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason}
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.s.model_name, "choices": [self._extras(choice, out, 0, True)],
                "usage": usage(self.n_prompt, len(out.token_ids))}

    def _chunk(self, choices: list[dict], **extra) -> str:
        return _sse({"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.s.model_name, "choices": choices, **extra})

    async def chunks(self, stream: RequestStream) -> AsyncIterator[str]:
        first, n_out = True, 0
        async for out in stream:
            delta: dict = {"role": "assistant", "content": out.text_delta} if first else {}
            if out.text_delta and not first:
                delta["content"] = out.text_delta
            start = len(out.token_ids) - len(out.new_token_ids)
            if first or delta or out.finished or self.entropy:
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": out.finish_reason if out.finished else None}
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                yield self._chunk([self._extras(choice, out, start, out.finished)])
            first = False
            n_out = len(out.token_ids)
        opts = self.b.stream_options
        if opts is not None and opts.include_usage:
            yield self._chunk([], usage=usage(self.n_prompt, n_out))
        yield "data: [DONE]\n\n"
