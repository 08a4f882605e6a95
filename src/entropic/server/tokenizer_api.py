"""/tokenize and /detokenize (vLLM's shapes): the served model's tokenizer over HTTP.

Tokenization of a large body takes milliseconds to seconds, so it runs in a worker thread,
never on the event loop that serves every other client's stream.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from entropic.server.errors import ApiError
from entropic.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state = request.app.state.entropic
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "tokenize: give exactly one of `prompt` (text) or `messages`",
                       param="prompt")
    tok = state.tokenizer
    try:
        if body.messages is not None:
            msgs = [m.as_template_dict() for m in body.messages]
            ids = await run_in_threadpool(tok.apply_chat_template, msgs,
                                          body.add_generation_prompt)
        else:
            ids = await run_in_threadpool(tok.encode, body.prompt)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = request.app.state.entropic
    state.check_model(body.model)
    vocab = state.tokenizer.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise ApiError(400, f"tokens[{i}]: token id {t} is not in [0, {vocab})",
                           param="tokens")
    return {"prompt": await run_in_threadpool(state.tokenizer.decode, body.tokens)}
