"""The OpenAI-compatible server, end to end: a real `entropic serve` process on 127.0.0.1,
driven by the official `openai` client and by raw HTTP (httpx) for bad input, disconnects
and load. One server for the whole module (model load once); torch runs one thread in it.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from entropic import kernels

pytestmark = pytest.mark.model

openai = pytest.importorskip("openai")

KEY = "test-key-123"
MAX_NUM_SEQS = 64  # with --max-waiting 0 the server holds at most 64 requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "entropic.cli", "serve", "--port", str(port), "--threads", "1",
           "--api-key", KEY, "--dtype", "float32", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", "0",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail("server did not become healthy in 180 s")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(server + "/v1/models", headers=_auth()).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=5).json()


def _wait_idle(base: str, timeout: float = 20.0) -> dict:
    """Wait until the server holds no request and no KV block; return /health."""
    deadline = time.time() + timeout
    while True:
        h = _health(base)
        if (h["requests_in_flight"] == 0 and h["requests_running"] == 0
                and h["requests_waiting"] == 0 and h["kv_blocks_used"] == 0):
            return h
        if time.time() > deadline:
            pytest.fail(f"server not idle after {timeout}s: {h}")
        time.sleep(0.1)


def _wait_for(base: str, pred, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        h = _health(base)
        if pred(h):
            return h
        if time.time() > deadline:
            pytest.fail(f"condition not reached after {timeout}s: {h}")
        time.sleep(0.05)


MSG = [{"role": "user", "content": "Name three colours."}]


# ---- the official client --------------------------------------------------------------
def test_models_and_health(server, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    h = _health(server)
    assert h["status"] == "ok" and h["kv_blocks_total"] > 0
    # how the model was loaded (the server was started with --dtype float32)
    assert h["dtype"] == "float32" and h["dtype_reason"] == "float32: as asked"
    assert h["isa"] in (*kernels.ISA_LEVELS, None)
    # quantization="auto" (the default) keeps floats when float32 is asked: int4 would
    # need bf16 activations
    assert h["quantization"] is None and "float32" in h["quantization_reason"]


def test_chat_streaming_matches_non_streaming(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=12,
                                          temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("stop", "length") and text
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model=model_name, messages=MSG, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == full.choices[0].finish_reason and all(f is None for f in finals[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_text_and_token_prompts(server, client, model_name):
    prompt = "The three primary colours are"
    a = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    ids = httpx.post(server + "/tokenize", json={"prompt": prompt}, headers=_auth()).json()
    assert ids["count"] == len(ids["tokens"]) == a.usage.prompt_tokens
    b = client.completions.create(model=model_name, prompt=ids["tokens"], max_tokens=8,
                                  temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    back = httpx.post(server + "/detokenize", json={"tokens": ids["tokens"]},
                      headers=_auth()).json()
    assert back["prompt"] == prompt
    parts = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=8,
                                           temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == a.choices[0].text
    assert parts[-1].choices[0].finish_reason == a.choices[0].finish_reason


def test_stop_and_seed(client, model_name):
    kw = dict(model=model_name, messages=MSG, max_tokens=16, temperature=1.0, top_p=0.9)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b
    full = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=16,
                                          temperature=0).choices[0].message.content
    stop = full.split()[1]
    cut = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=16,
                                         temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content
    assert full.startswith(cut.message.content)


def _tau(entropies: list[float]) -> float:
    return sum(max(0.0, a - b) for a, b in zip(entropies, entropies[1:]))


def test_chat_logprobs_and_entropy(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=3)
    ch = r.choices[0]
    content = ch.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == ch.message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.logprob <= 0 and t.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy
    ent = ch.model_extra["entropic"]
    assert len(ent["entropies"]) == len(content) and all(h >= 0 for h in ent["entropies"])
    assert ent["temperatures"] == [0.0] * len(content)
    assert ent["tempered_entropies"] == [0.0] * len(content)  # greedy: a point mass
    assert ent["tau"] == pytest.approx(_tau(ent["entropies"]), abs=1e-4)


def test_thermostat_extension_streams_entropy(server, model_name):
    from entropic.control.thermostat import next_temperature
    body = {"model": model_name, "messages": MSG, "max_tokens": 24, "temperature": 1.0,
            "seed": 3, "stream": True,
            "entropic": {"thermostat": {"target_entropy": 1.0, "eta": 0.5, "t_min": 0.5,
                                        "t_max": 1.5, "h_min": 0.2}}}
    ents, temps, tempered, last = [], [], [], None
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers=_auth(),
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ents += choice["entropic"]["entropies"]
            temps += choice["entropic"]["temperatures"]
            tempered += choice["entropic"]["tempered_entropies"]
            last = choice
    assert last["finish_reason"] is not None and len(ents) == len(temps) == len(tempered) > 1
    assert all(0.5 - 1e-6 <= t <= 1.5 + 1e-6 for t in temps)
    assert temps[0] == pytest.approx(1.0) and len(set(temps)) > 1  # the controller acts
    assert last["entropic"]["tau"] == pytest.approx(_tau(ents), abs=1e-4)
    # H^T_t is the value the thermostat stepped on: its law, fed the reported H^T_t
    # (floored at h_min), gives every next temperature (the API's are float32)
    assert all(h is not None and h >= 0 for h in tempered)
    for i in range(len(temps) - 1):
        want = next_temperature(temps[i], max(tempered[i], 0.2), 1.0, 0.5, 0.5, 1.5,
                                "stabilize")
        assert temps[i + 1] == pytest.approx(want, rel=1e-5), i


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completions_report_tempered_entropy(client, model_name, temperature):
    """Without the thermostat, H^T is the entropy at the sampled temperature: H itself at
    T = 1, and a measured value elsewhere (below H for T < 1 on every token)."""
    r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8,
                                  temperature=temperature, seed=5,
                                  extra_body={"entropic": {"entropy": True}})
    ent = r.choices[0].model_extra["entropic"]
    hs, hts = ent["entropies"], ent["tempered_entropies"]
    assert len(hts) == len(hs) == r.usage.completion_tokens == 8
    if temperature == 1.0:
        assert hts == hs
    else:
        assert all(0 <= ht < h for ht, h in zip(hts, hs) if h > 1e-3), (hts, hs)


def test_echo_scores_prompt_tokens(server, client, model_name):
    """echo + logprobs with max_tokens 0 scores the prompt (log-likelihood evaluation); the
    score of a token equals its logprob when the model generated it."""
    ids = httpx.post(server + "/tokenize", json={"prompt": "The capital of France is"},
                     headers=_auth()).json()["tokens"]
    gen = client.completions.create(model=model_name, prompt=ids, max_tokens=1, temperature=0,
                                    logprobs=2).choices[0]
    next_id = _token_id(server, gen.text)
    scored = client.completions.create(model=model_name, prompt=ids + [next_id],
                                       max_tokens=0, echo=True, logprobs=1)
    ch = scored.choices[0]
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 1 and scored.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.token_logprobs[-1] == pytest.approx(gen.logprobs.token_logprobs[0], abs=0.05)
    assert ch.text == "".join(lp.tokens) and lp.text_offset[0] == 0
    both = client.completions.create(model=model_name, prompt=ids, max_tokens=3, echo=True,
                                     logprobs=1, temperature=0)
    assert len(both.choices[0].logprobs.tokens) == len(ids) + both.usage.completion_tokens
    assert both.choices[0].text.startswith("The capital of France is")


def _token_id(server: str, text: str) -> int:
    ids = httpx.post(server + "/tokenize", json={"prompt": text}, headers=_auth()).json()
    assert ids["count"] == 1, ids
    return ids["tokens"][0]


# ---- bad input ---------------------------------------------------------------------------
def _post(server: str, path: str, body, headers=None, raw: bool = False) -> httpx.Response:
    h = {"Content-Type": "application/json", **(_auth() if headers is None else headers)}
    data = body if raw else json.dumps(body)
    return httpx.post(server + path, content=data, headers=h, timeout=30)


def _assert_error(r: httpx.Response, status: int, param: str | None = None,
                  words: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if words is not None:
        assert words in err["message"], err
    return err


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}])
def test_api_key_required(server, model_name, headers):
    body = {"model": model_name, "prompt": "hi", "max_tokens": 1}
    err = _assert_error(_post(server, "/v1/completions", body, headers=headers), 401)
    assert err["type"] == "authentication_error"
    assert _post(server, "/tokenize", {"prompt": "hi"}, headers=headers).status_code == 401
    assert httpx.get(server + "/health").status_code == 200  # probes stay open
    assert httpx.get(server + "/metrics").status_code == 200


def test_foreign_host_header_is_refused(server):
    """Bound to loopback, the server answers loopback names only (DNS rebinding)."""
    r = httpx.get(server + "/health", headers={"Host": "rebind.example:8000"})
    assert _assert_error(r, 400, None, "rebind.example")["code"] == "invalid_host"
    assert httpx.get(server + "/health", headers={"Host": "localhost"}).status_code == 200


def test_schema_is_not_served_by_default(server):
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(server + path, headers=_auth()).status_code == 404


def test_body_over_the_limit_is_413(server, model_name):
    """The default limit is sized to the context: 128 bytes per token, at least 1 MiB."""
    body = {"model": model_name, "prompt": "a " * (1 << 20), "max_tokens": 1}
    err = _assert_error(_post(server, "/v1/completions", body), 413, None, "limit of")
    assert err["code"] == "body_too_large"
    data = json.dumps(body).encode()

    def chunked():  # no Content-Length: the limit trips while the body is read
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]

    r = httpx.post(server + "/v1/completions", content=chunked(), timeout=30,
                   headers={"Content-Type": "application/json", **_auth()})
    assert _assert_error(r, 413)["code"] == "body_too_large"
    assert _health(server)["status"] == "ok"


def test_client_sees_auth_error(server, model_name):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model_name, messages=MSG, max_tokens=1)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "x"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "number"),
    ("/v1/completions", {"prompt": 5}, "prompt", None),
    ("/v1/completions", {"max_tokens": 3}, "prompt", "required"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", "n=1"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "[0, 10000]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": [1, 10 ** 9]}, "prompt", "token id"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens",
     "exceeds the context length"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "entropic": {"thermostat": {"speed": 1}}},
     "entropic", None),
    ("/v1/completions", {"prompt": "hi", "entropic": {"thermostat": {"eta": -1}}},
     "thermostat.eta", "(0, 1000]"),
    ("/v1/completions", {"prompt": "hi", "temperature": 0, "entropic": {"thermostat": {}}},
     "temperature", "thermostat"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages", None),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 9000}, "max_tokens",
     "context length"),
    ("/detokenize", {"tokens": [-1]}, "tokens", None),
])
def test_bad_request_is_400(server, model_name, path, body, param, words):
    if path.startswith("/v1"):
        body = {"model": model_name, **body}
    _assert_error(_post(server, path, body), 400, param, words)


def test_malformed_json_and_unknown_model(server, model_name):
    err = _assert_error(_post(server, "/v1/chat/completions", '{"messages": [', raw=True), 400)
    assert "malformed JSON" in err["message"]
    _assert_error(_post(server, "/v1/completions", "[1, 2]", raw=True), 400)
    err = _assert_error(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}),
                        404, "model")
    assert err["code"] == "model_not_found"


def test_client_sees_context_overflow(client, model_name):
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model_name, prompt="hi", max_tokens=10 ** 5)


# ---- robustness --------------------------------------------------------------------------
LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
        "temperature": 0}


def _metric(server: str, name: str) -> float:
    for line in httpx.get(server + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_disconnect_mid_stream_frees_kv_blocks(server, model_name):
    _wait_idle(server)
    aborted = _metric(server, "entropic_requests_aborted")
    body = {"model": model_name, "stream": True, **LONG}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=_auth(),
                      timeout=60) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in: the request holds blocks
        assert any(g.startswith("data: ") for g in got)
        h = _health(server)
        assert h["requests_running"] == 1 and h["kv_blocks_used"] > 0
    assert _wait_idle(server, 10)["kv_blocks_used"] == 0
    assert _metric(server, "entropic_requests_aborted") == aborted + 1


def test_disconnect_non_streamed_frees_kv_blocks(server, model_name):
    _wait_idle(server)
    errors = []

    def call():
        try:
            httpx.post(server + "/v1/completions", json={"model": model_name, **LONG},
                       headers=_auth(), timeout=3)
        except httpx.ReadTimeout as e:  # the client gives up and closes the connection
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    _wait_for(server, lambda h: h["requests_running"] == 1 and h["kv_blocks_used"] > 0)
    t.join()
    assert errors, "the request should still have been running when the client left"
    assert _wait_idle(server, 10)["kv_blocks_used"] == 0


def test_full_server_answers_429(server, model_name):
    """max_num_seqs + max_waiting (64 + 0) requests held: one more gets 429; closing the
    64 streams aborts them all and frees every block."""
    _wait_idle(server)
    body = {"model": model_name, "stream": True, **LONG}

    async def run() -> int:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(headers=_auth(), timeout=60, limits=limits) as http:
            streams = []
            try:
                for _ in range(MAX_NUM_SEQS):
                    cm = http.stream("POST", server + "/v1/completions", json=body)
                    streams.append(cm)
                    resp = await cm.__aenter__()
                    assert resp.status_code == 200
                await asyncio.to_thread(
                    _wait_for, server, lambda h: h["requests_in_flight"] == MAX_NUM_SEQS)
                extra = await http.post(server + "/v1/completions",
                                        json={"model": model_name, "prompt": "hi"})
                _assert_error(extra, 429)
                assert extra.headers["Retry-After"] == "1"
                assert _metric(server, 'entropic_requests_rejected_total{reason="queue_full"}') >= 1
                return extra.status_code
            finally:
                for cm in streams:
                    await cm.__aexit__(None, None, None)

    assert asyncio.run(run()) == 429
    assert _wait_idle(server, 20)["kv_blocks_used"] == 0


def _concurrent_prompts(n: int) -> list[str]:
    from entropic.bench.datasets import load_sharegpt_prompts
    out = [r["prompt"] for r in load_sharegpt_prompts(300) if len(r["prompt"]) < 400]
    assert len(out) >= n
    return out[:n]


def test_64_concurrent_streams_complete_and_match(server, model_name):
    """64 streaming clients at once all finish, each with the tokens of its own greedy
    non-streamed run (batch composition differs between the runs: a divergence is allowed
    only where the two best tokens were a near-tie)."""
    _wait_idle(server)
    prompts = _concurrent_prompts(64)
    aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0,
                                 timeout=120)
    kw = dict(model=model_name, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)

    async def plain(p):
        r = await aclient.chat.completions.create(messages=[{"role": "user", "content": p}],
                                                  **kw)
        return r.choices[0].message.content, r.choices[0].logprobs.content, \
            r.choices[0].finish_reason

    async def streamed(p):
        text, lps, finish, done = "", [], None, 0
        stream = await aclient.chat.completions.create(
            messages=[{"role": "user", "content": p}], stream=True, **kw)
        async for c in stream:
            ch = c.choices[0]
            text += ch.delta.content or ""
            lps += ch.logprobs.content if ch.logprobs else []
            if ch.finish_reason is not None:
                finish, done = ch.finish_reason, done + 1
        assert done == 1
        return text, lps, finish

    async def run():
        async with aclient:
            a = await asyncio.gather(*(plain(p) for p in prompts))
            b = await asyncio.gather(*(streamed(p) for p in prompts))
        return a, b

    plain_out, stream_out = asyncio.run(run())
    diverged = 0
    for (t1, l1, f1), (t2, l2, f2) in zip(plain_out, stream_out):
        assert f2 in ("stop", "length") and len(l2) >= 1
        # the stream's text is complete: every token's text (an EOS shows in logprobs only)
        assert t2 == "".join(x.token for x in (l2[:-1] if f2 == "stop" else l2))
        if t1 == t2:
            assert f1 == f2
            continue
        diverged += 1
        i = next(i for i, (x, y) in enumerate(zip(l1, l2)) if x.token != y.token)
        for lp in (l1[i], l2[i]):
            top = lp.top_logprobs
            assert top[0].logprob - top[1].logprob < 0.02, (i, t1, t2)
    assert diverged <= 6
    _wait_idle(server)


def test_metrics_exposed(server):
    text = httpx.get(server + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            values[name] = float(v)
    assert values["entropic_generation_tokens_total"] > 0
    assert values["entropic_time_to_first_token_seconds_count"] > 0
    assert values["entropic_e2e_request_latency_seconds_count"] > 0
    assert values["entropic_time_per_output_token_seconds_count"] > 0
    assert values["entropic_kv_blocks_used"] == 0 and values["entropic_kv_blocks_total"] > 0
    for name in ("entropic_requests_running", "entropic_requests_waiting",
                 "entropic_kv_cache_usage_ratio", "entropic_tau_rate_nats_per_second",
                 "entropic_pruned_block_fraction"):
        assert name in values
    assert 0 < values["entropic_mean_entropy_nats"] < 12
    assert values["entropic_tau_nats"] > 0
    assert "entropic_requests_aborted" in values
