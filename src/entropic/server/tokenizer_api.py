"""/tokenize, /detokenize and /tokenizer_info (vLLM's shapes): the served model's tokenizer
over HTTP, as lm-evaluation-harness's remote tokenizer (`tokenizer_backend=remote`) uses it.

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
            ids = await run_in_threadpool(tok.encode, body.prompt, body.add_special_tokens)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages") from None
    out = {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


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
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state = request.app.state.entropic
    state.check_model(body.model)
    vocab = state.tokenizer.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise ApiError(400, f"tokens[{i}]: token id {t} is not in [0, {vocab})",
                           param="tokens")
    return {"prompt": await run_in_threadpool(state.tokenizer.decode, body.tokens)}
