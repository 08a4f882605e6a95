"""/tokenize, /detokenize and /tokenizer_info (vLLM's shapes): the served model's tokenizer
over HTTP, as lm-evaluation-harness's remote tokenizer (`tokenizer_backend=remote`) uses it.

Tokenization of a large body takes milliseconds to seconds, and so does encoding a
million token ids as JSON, so both run in a worker thread, never on the event loop that
serves every other client's stream. The thread encodes long lists a slice at a time and
gives the GIL away after each slice: one C-level json.dumps of the whole list would hold it
throughout, and even between slices a thread that always wants the GIL makes the engine
thread wait up to the interpreter's switch interval (5 ms) each time it takes the GIL back
after a torch op, which slowed other clients' streams by ~0.3 s per million ids.
"""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from entropic.server.errors import ApiError
from entropic.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()
JSON_SLICE = 4096  # list items per json.dumps call (~0.3 ms)


def json_bytes(obj: dict) -> bytes:
    """`obj` (a flat dict) as JSON, its long list values encoded slice by slice."""
    parts = []
    for key, value in obj.items():
        if isinstance(value, list) and len(value) > JSON_SLICE:
            items = ",".join(_slices(value))
            parts.append(f"{json.dumps(key)}:[{items}]")
        else:
            parts.append(f"{json.dumps(key)}:{json.dumps(value, separators=(',', ':'))}")
    return ("{" + ",".join(parts) + "}").encode()


def _slices(value: list):
    for i in range(0, len(value), JSON_SLICE):
        yield json.dumps(value[i:i + JSON_SLICE], separators=(",", ":"))[1:-1]
        time.sleep(0)  # let a waiting thread (the engine's) take the GIL now


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = request.app.state.entropic
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "tokenize: give exactly one of `prompt` (text) or `messages`",
                       param="prompt")
    tok = state.tokenizer

    def work() -> bytes:
        if body.messages is not None:
            msgs = [m.as_template_dict() for m in body.messages]
            ids = tok.apply_chat_template(msgs, body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt, body.add_special_tokens)
        out = {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return json_bytes(out)

    try:
        return _json(await run_in_threadpool(work))
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """What a client needs to tokenize like the server: special tokens, the chat template,
    the vocabulary size and context length (the fields of a tokenizer_config.json)."""
    state = request.app.state.entropic
    tok = state.tokenizer
    return {"tokenizer_class": tok.class_name, **tok.special_tokens(),
            "eos_token_ids": list(tok.eos_token_ids), "chat_template": tok.chat_template,
            "model_max_length": state.max_model_len, "vocab_size": tok.vocab_size}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = request.app.state.entropic
    state.check_model(body.model)
    vocab = state.tokenizer.vocab_size

    def work() -> bytes:
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise ApiError(400, f"tokens[{i}]: token id {t} is not in [0, {vocab})",
                               param="tokens")
        return json_bytes({"prompt": state.tokenizer.decode(body.tokens)})

    return _json(await run_in_threadpool(work))
