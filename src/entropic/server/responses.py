"""Response bodies and stream chunks in the OpenAI shapes, plus the `entropic` extension.

Token strings are the decoded text of each token (what OpenAI's `token` fields hold), so a
byte-level BPE piece that is half a UTF-8 character reads as U+FFFD; `bytes` gives its
UTF-8 encoding.
"""
from __future__ import annotations

from entropic.outputs import RequestOutput, TokenLogprob


class TokenText:
    """Decoded text of single tokens, cached (the same ids recur in every response)."""

    def __init__(self, tokenizer, max_entries: int = 1 << 16) -> None:
        self.tok = tokenizer
        self._cache: dict[int, str] = {}
        self._max = max_entries

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._max:
                self._cache[token_id] = s
        return s


# ---- chat -------------------------------------------------------------------------------
def chat_logprob_entries(lps: list[TokenLogprob], text: TokenText) -> list[dict]:
    """`choices[i].logprobs.content`: one entry per token, top alternatives by likelihood."""
    out = []
    for lp in lps:
        tok = text(lp.token_id)
        top = sorted(lp.top.items(), key=lambda kv: -kv[1])
        out.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                    "top_logprobs": [{"token": text(t), "logprob": v,
                                      "bytes": list(text(t).encode())} for t, v in top]})
    return out


# ---- completions ------------------------------------------------------------------------
def completion_logprobs(entries: list[TokenLogprob | tuple[int, None]], text: TokenText,
                        offset: int) -> dict:
    """`choices[i].logprobs` of the legacy completions API. An entry may be (token_id, None)
    for a token without a score (the first prompt token under echo). `offset` is the
    character offset of the first token in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for e in entries:
        if isinstance(e, TokenLogprob):
            tid, lp, top = e.token_id, e.logprob, {text(t): v for t, v in e.top.items()}
        else:
            tid, lp, top = e[0], None, None
        s = text(tid)
        tokens.append(s)
        token_lps.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


# ---- the entropic extension ---------------------------------------------------------------
def entropic_block(out: RequestOutput, start: int, final: bool) -> dict:
    """Per-token entropy (nats, temperature-1 model distribution before truncation), the
    temperature each token was sampled at and the tempered entropy H^T of the distribution
    it was drawn from (nats, softmax(logits / T) before truncation; 0 for greedy), for
    output tokens [start:]; on the final chunk (or a whole response) the request's entropic
    time too."""
    block: dict = {"entropies": out.entropies[start:], "temperatures": out.temperatures[start:],
                   "tempered_entropies": out.tempered_entropies[start:]}
    if final and out.entropic is not None:
        r = out.entropic
        block.update(tau=r.tau, mean_entropy=r.mean_entropy, tau_per_tflop=r.tau_per_tflop,
                     tau_per_second=r.tau_per_second)
    if final and out.speculation is not None:
        sp = out.speculation
        block["speculation"] = {
            "drafted_tokens": sp.drafted_tokens, "accepted_tokens": sp.accepted_tokens,
            "drafts": sp.drafts, "decode_steps": sp.decode_steps,
            "acceptance_rate": sp.acceptance_rate,
            "mean_acceptance_length": sp.mean_acceptance_length,
            "tokens_per_forward": sp.tokens_per_forward}
    return block


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

