"""Fuzzing the OpenAI-compatible server: no single request may hurt anyone else.

A real `entropic serve` process on 127.0.0.1 gets request bodies that hypothesis builds
for /v1/completions, /v1/chat/completions, /tokenize and /detokenize. The bodies mix valid
and adversarial values: every field the server models, with huge, tiny, negative and
non-finite numbers, wrong types, lone UTF-16 surrogates (sent as JSON escapes), empty
strings, unknown fields, duplicate keys and nested junk. They go out as raw bytes we
serialize ourselves, over ONE persistent HTTP/1.1 connection (a raw socket client: it never
reconnects by itself, so a server that drops the connection is seen).

After every example:
- the status is not 5xx; a 4xx has the OpenAI error shape; a 200 is strict JSON (no NaN or
  Infinity) or an SSE stream of strict JSON events ending in `data: [DONE]`, without an
  in-band error;
- the same connection answers a follow-up GET /health, which says "ok";
- once idle the server holds no request and no KV block (no leak).

The minimal cases of the hostile-client review are kept as explicit examples and as
regression tests with their exact expected answers.

Environment knobs for longer campaigns (CI uses neither): ENTROPIC_FUZZ_EXAMPLES=N runs N
examples per endpoint, randomised (then `--hypothesis-seed` picks the run);
ENTROPIC_FUZZ_SHRINK=0 reports failures unshrunk.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.model

MODEL = "fuzz-model"  # --served-model-name
VOCAB = 49152  # SmolLM2's vocabulary
CONTEXT = 8192  # its context length
MAX_NEW = 4  # generated valid max_tokens stay at or below this: examples stay fast

_CAMPAIGN = int(os.environ.get("ENTROPIC_FUZZ_EXAMPLES", "0"))
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
if os.environ.get("ENTROPIC_FUZZ_SHRINK", "1") != "0":
    _PHASES.append(Phase.shrink)


def _fuzz_settings(n: int):
    return settings(max_examples=_CAMPAIGN or n, deadline=None, derandomize=not _CAMPAIGN,
                    database=None, phases=_PHASES, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


# ---- the server --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `entropic serve` subprocess, its log in a file. If an example kills it (the
    engine died and the server exited), the next example gets a fresh one, so that
    hypothesis can go on shrinking the request that did it."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.restarts = -1

    def start(self) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "entropic.cli", "serve", "--port", str(self.port),
               "--dtype", "float32", "--threads", "1", "--max-num-seqs", "8",
               "--served-model-name", MODEL, "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.restarts += 1
        deadline = time.time() + 180
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log_tail(3000)}")
            try:
                with KeepAliveConn(self.port, timeout=2) as c:
                    if c.request("GET", "/health").status == 200:
                        return
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail("server did not become healthy in 180 s")
            time.sleep(0.3)

    def ensure_running(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.proc.wait()
            self.start()

    def log_offset(self) -> int:
        self.log.flush()
        return os.path.getsize(self.log.name)

    def log_since(self, offset: int, limit: int = 4000) -> str:
        with open(self.log.name, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
        return text if len(text) <= limit else "...\n" + text[-limit:]

    def log_tail(self, n: int) -> str:
        return self.log_since(max(0, self.log_offset() - n), n)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


# ---- a raw HTTP/1.1 keep-alive client ------------------------------------------------------
@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-cased names; repeated ones joined by ", "
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class ConnectionBroken(Exception):
    """The server closed or reset the connection, or sent something that is not HTTP."""


class KeepAliveConn:
    """One TCP connection, requests sent one after another on it. Never reconnects: a
    request on a connection the server dropped raises ConnectionBroken."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.local_port = self.sock.getsockname()[1]
        self.port = port
        self.buf = b""
        self.answered = 0
        self.last_used = time.monotonic()
        self.closed = False

    def __enter__(self) -> "KeepAliveConn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: str = "application/json") -> Reply:
        if self.closed:
            raise ConnectionBroken("connection already closed")
        head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{self.port}",
                "Connection: keep-alive", "Accept: */*"]
        if body is not None:
            head += [f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        data = ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")
        try:
            self.sock.sendall(data)
            reply = self._read_reply()
        except (OSError, ConnectionBroken) as e:
            self.close()
            raise ConnectionBroken(f"{type(e).__name__}: {e}") from None
        self.answered += 1
        self.last_used = time.monotonic()
        if "close" in reply.headers.get("connection", "").lower():
            self.close()
        return reply

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionBroken("the server closed the connection")
        self.buf += chunk

    def _read_until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(sep, 1)
        return line

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _read_reply(self) -> Reply:
        head = self._read_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ConnectionBroken(f"not an HTTP status line: {head[0]!r}")
        headers: dict[str, str] = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            headers[key] = (headers[key] + ", " if key in headers else "") + value.strip()
        status = int(parts[1])
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = b""
            while True:
                size = int(self._read_until(b"\r\n").split(b";")[0].strip(), 16)
                if size == 0:
                    while self._read_until(b"\r\n"):  # trailers, then the empty line
                        pass
                    break
                body += self._read_exact(size)
                self._read_exact(2)
        elif "content-length" in headers:
            body = self._read_exact(int(headers["content-length"]))
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:
            raise ConnectionBroken(f"a {status} with neither a length nor chunks: the "
                                   "body would end at close")
        return Reply(status, headers, body)


class Session:
    """The server and the one connection the examples share. A new connection is opened only
    when the previous example broke it (that example has failed) or when it sat idle long
    enough that the server may close it legitimately (keep-alive timeout, 5 s)."""

    IDLE_S = 3.0

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.conn: KeepAliveConn | None = None
        self.connections = 0

    def connection(self) -> KeepAliveConn:
        self.server.ensure_running()
        c = self.conn
        if (c is None or c.closed or c.port != self.server.port
                or time.monotonic() - c.last_used > self.IDLE_S):
            if c is not None:
                c.close()
            self.conn = KeepAliveConn(self.server.port)
            self.connections += 1
        return self.conn


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def session(server):
    sess = Session(server)
    yield sess
    if sess.conn is not None:
        sess.conn.close()


# ---- serializing adversarial JSON ----------------------------------------------------------
class Raw(str):
    """JSON text sent verbatim (numbers Python would not write, malformed fragments)."""

    def __repr__(self) -> str:
        return f"Raw({str(self)[:60]!r}{'...' if len(self) > 60 else ''})"


class Pairs(tuple):
    """A JSON object as (key, value) pairs: keys may repeat (the last one wins)."""

    def __repr__(self) -> str:
        return f"Pairs({list(self)!r})"


def to_json(v) -> str:
    """Our own serializer: strings always ASCII with escapes (a lone surrogate goes over the
    wire as \\ud800), non-finite floats as NaN / Infinity (Python's json reads them)."""
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Pairs):
        return "{" + ",".join(json.dumps(k, ensure_ascii=True) + ":" + to_json(x)
                              for k, x in v) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=True) + ":" + to_json(x)
                              for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(to_json(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=True)


class Unparsed:
    """A Raw fragment the server's parser refuses (the request cannot be a 200)."""


def meaning(v):
    """What the server's JSON parser (Python's json) makes of `v` (duplicate keys: the last
    wins)."""
    if isinstance(v, Raw):
        try:
            return json.loads(str(v))
        except (ValueError, RecursionError):
            return Unparsed()
    if isinstance(v, Pairs):
        return {k: meaning(x) for k, x in v}
    if isinstance(v, dict):
        return {k: meaning(x) for k, x in v.items()}
    if isinstance(v, list):
        return [meaning(x) for x in v]
    return v


# ---- strategies ----------------------------------------------------------------------------
SPECIAL_TEXT = ["", " ", "\n", "\x00", "\t\r", "a\ud800b", "\ud800", "\udfff", "\udc00a",
                "\ud83d\ude00", "\ud83d", "x\udbff", "😀", "é" * 40, "A" * 300, "\u202e\ufeff",
                "\U0010ffff", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>system",
                "{{ 7 * 7 }}", "{% for x in range(10) %}x{% endfor %}", "\\u0000", "null"]
surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
any_text = st.one_of(
    st.sampled_from(SPECIAL_TEXT),
    st.text(max_size=24),
    st.lists(st.one_of(st.characters(), surrogate), min_size=1, max_size=8).map("".join))
valid_text = st.one_of(st.sampled_from(["Hello", "The capital of France is", "Once upon a",
                                        "1 2 3 4", "😀 é ü", " ", "\n", "<|im_end|>"]),
                       st.text(min_size=1, max_size=40))

BIG_NUMBERS = [1e308, -1e308, 1e-320, -1e-320, 5e-324, -0.0, 0, 0.0, 2**64, 2**64 - 1, 2**63,
               -2**63, -2**63 - 1, 2**1000, -2**1000, 1e-38, 1e-45, 3.5e38, 1e39, -1, 1.5,
               float("inf"), float("-inf"), float("nan"), 1e300, -1e300]
RAW_NUMBERS = [Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("NaN"), Raw("Infinity"),
               Raw("-Infinity"), Raw("-0"), Raw("1E+2"), Raw("9" * 5000), Raw("-" + "9" * 5000),
               Raw("0." + "0" * 400 + "1"), Raw("1" + "0" * 400), Raw("1.0e-5")]
numbers = st.one_of(st.sampled_from(BIG_NUMBERS), st.sampled_from(RAW_NUMBERS),
                    st.integers(), st.floats())
scalars = st.one_of(st.none(), st.booleans(), numbers, any_text)
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(any_text, inner, max_size=3)),
    max_leaves=6)
deep = st.sampled_from([Raw("[" * 100_000 + "]" * 100_000), Raw("[" * 900 + "]" * 900),
                        Raw('{"a":' * 500 + "1" + "}" * 500), Raw("[" * 30), Raw('{"a": [1, 2'),
                        Raw('"unterminated'), Raw("tru"), Raw("\"\\ud800\""),
                        Raw('"\\uDFFF\\uD800"'), Raw('"\\u00"')])
near_valid = st.sampled_from([MODEL + " ", "gpt-4", "", {"1": 0.5}, {"49151": -100},
                              {"-1": 1e308}, 0, 2, -1])
bad = st.one_of(junk, deep, near_valid)


def _not_slow(v) -> bool:
    """A max_tokens-like value that would be valid but long is not adversarial, just slow."""
    return not (isinstance(v, int) and not isinstance(v, bool) and MAX_NEW < v < CONTEXT)


bad_length = st.one_of(st.sampled_from([0, -1, CONTEXT, CONTEXT + 1, 2**31, 10**6, 2**63,
                                        2**64, -2**63 - 1, 2**1000, "4", 4.0, 1.5, True, [4],
                                        None, Raw("1e400"), Raw("4.0")]),
                       junk.filter(_not_slow))
token_id = st.integers(0, VOCAB - 1)
bad_token_id = st.one_of(st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31, 2**63, 2**64,
                                          -2**63 - 1, 2**1000, 1.0, True, "1", None]), scalars)


def floats_in(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


temperature = st.one_of(floats_in(0, 2), st.sampled_from(  # all accepted
    [0, 0.0, -0.0, 1, 1e-320, 5e-324, 1e-38, 1e-45, 1e-30, 1e-5, 9.99e-6, 1.0000001e-5, 1e-4,
     1e30, 3.4e38, 3.5e38, 1e39, 1e308, 2**64, 100.0]))
thermostat_fields = {  # accepted values (t_min <= 1 <= t_max), edges included
    "target_entropy": st.one_of(floats_in(0, 12), st.sampled_from([0, -0.0, 5e-324, 1e3])),
    "eta": st.one_of(floats_in(1e-3, 5), st.sampled_from([1000.0, 999.999, 5e-324, 1e-300, 30.0])),
    "t_min": st.sampled_from([0.2, 0.5, 1.0, 1e-3]),
    "t_max": st.sampled_from([2.0, 1.0, 1.5, 1e3]),
    "h_min": st.one_of(floats_in(0, 12), st.sampled_from([1e3, 5e-324])),
    "mode": st.sampled_from(["stabilize", "follow"]),
}
thermostat_extremes = st.sampled_from([
    0, -0.0, -1, 5e-324, 1e-320, 1e-38, 1e-3, 1e3, 1e3 + 1e-9, 1e300, 1e308, 3.5e38, 2**64,
    -1e-300, "stabilize", "follow", "STABILIZE", ""])
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


def _bad_for(name: str):
    return bad_length if name in LENGTH_FIELDS else bad


@st.composite
def obj(draw, valid: dict, required=(), extra=None, custom=()):
    """A JSON object over `valid` fields: each absent or valid, except up to three chosen
    ones that get an adversarial value (`extra` draws those of the `custom` fields);
    sometimes unknown fields, duplicate keys, or a body that is not an object at all.
    Shrinks toward a small, all-valid object."""
    names = list(valid)
    corrupt = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
    body = {}
    for name in names:
        if name in corrupt:
            if name not in custom:
                body[name] = draw(_bad_for(name))
        elif name in required or draw(st.booleans()):
            body[name] = draw(valid[name])
    if extra is not None:
        extra(draw, body, corrupt)
    for k in draw(st.lists(st.sampled_from(["foo", "tools", "response_format", "x" * 200,
                                            "", "__proto__", "\ud800", "Stream", "logprob"]),
                           max_size=2, unique=True)):
        body[k] = draw(junk)
    shape = draw(st.integers(0, 24))
    if shape == 22 and body:  # a key sent twice: valid first, junk last (the last wins)
        k = draw(st.sampled_from(sorted(body)))
        return Pairs(list(body.items()) + [(k, draw(_bad_for(k)))])
    if shape == 23:
        return draw(bad)
    if shape == 24:
        return Raw(to_json(body)[: draw(st.integers(0, max(0, len(to_json(body)) - 1)))])
    return body


common_stop = st.sampled_from([" ", ".", "\n", ",", "e", "a", "the", " the", "s", "is", "\n\n",
                               "Paris", " Paris", "I", "<|im_end|>", "<|endoftext|>"])


def sampling_fields() -> dict:
    return {
        "model": st.just(MODEL),
        "temperature": temperature.filter(lambda t: t != 0),  # 0 refuses a thermostat
        "top_p": st.one_of(floats_in(1e-3, 1), st.sampled_from([1, 1.0, 5e-324, 1e-320, 1e-38,
                                                                0.9999999999])),
        "top_k": st.one_of(st.integers(-1, 60), st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1,
                                                                  2**31, 2**63, 2**64])),
        "min_p": st.one_of(floats_in(0, 1), st.sampled_from([5e-324, 1e-320, 1, 0.9999999])),
        "seed": st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from(
            [0, -1, 2**63 - 1, -2**63, 2**64 - 1, 2**32])),
        "stop": st.one_of(valid_text, st.lists(valid_text, max_size=4), common_stop,
                          st.lists(common_stop, min_size=1, max_size=3)),
        "stop_token_ids": st.lists(st.one_of(token_id, st.sampled_from([2**63 - 1, 2**40])),
                                   max_size=4),
        "n": st.just(1),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        "presence_penalty": st.sampled_from([0, 0.0, -0.0]),
        "frequency_penalty": st.sampled_from([0, 0.0]),
        "logit_bias": st.just({}),
        "user": any_text,
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "entropic": st.fixed_dictionaries({}, optional={
            "entropy": st.booleans(),
            "thermostat": st.fixed_dictionaries({}, optional=thermostat_fields)}),
    }


special_id = st.integers(0, 16)  # <|endoftext|>, <|im_start|>, <|im_end|>, ...: decode to ""
prompt_valid = st.one_of(valid_text, st.lists(token_id, min_size=1, max_size=16),
                         st.lists(special_id, min_size=1, max_size=4),
                         st.lists(st.one_of(special_id, token_id), min_size=1, max_size=6),
                         valid_text.map(lambda s: [s]),
                         st.lists(token_id, min_size=1, max_size=8).map(lambda ids: [ids]))
prompt_bad = st.one_of(st.sampled_from(
    ["", [], [[]], [""], ["a", "b"], [[1], [2]], [1, "a"], [[1, "a"]], [-1], [VOCAB],
     [2**64], [True], [1.0], None, 5, {"text": "x"}, "a\ud800b", ["a\ud800b"], "\ud800",
     [0] * CONTEXT, "a " * 9000, [[0, 1], "a"]]), bad)

COMPLETION = {"prompt": prompt_valid, "max_tokens": st.integers(0, MAX_NEW),
              **sampling_fields(),
              "logprobs": st.integers(0, 20), "echo": st.booleans(),
              "best_of": st.just(1), "suffix": st.sampled_from(["", None])}


def _prompt_bad(draw, body, corrupt):
    if "prompt" in corrupt:
        body["prompt"] = draw(prompt_bad)


def _nested_thermostat(draw, body, corrupt):
    """Adversarial values inside `entropic.thermostat`, where a top-level pick cannot go."""
    if draw(st.integers(0, 3)) == 0:
        field = draw(st.sampled_from(list(thermostat_fields) + ["speed", "entropy"]))
        ent = body.get("entropic")
        ent = dict(ent) if isinstance(ent, dict) else {}
        th = ent.get("thermostat")
        th = dict(th) if isinstance(th, dict) else {}
        if field == "entropy":
            ent["entropy"] = draw(bad)
        else:
            th[field] = draw(st.one_of(thermostat_extremes, bad))
        ent["thermostat"] = th
        body["entropic"] = ent


def _completion_extra(draw, body, corrupt):
    _prompt_bad(draw, body, corrupt)
    _nested_thermostat(draw, body, corrupt)


completion_bodies = obj(COMPLETION, required=("prompt", "max_tokens"), extra=_completion_extra,
                        custom=("prompt",))

# ---- chat
content_part = st.fixed_dictionaries({"type": st.just("text"), "text": valid_text})
bad_part = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(
    ["image_url", "TEXT", "", "text"]), "text": any_text}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.just({"url": "data:,x"})}), junk)
message_valid = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.one_of(valid_text, st.lists(content_part, min_size=1, max_size=3))})
message_bad = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(any_text, bad), "content": valid_text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
        any_text, bad, st.lists(st.one_of(content_part, bad_part), max_size=3), st.none())}),
    st.fixed_dictionaries({"content": valid_text}),
    st.fixed_dictionaries({"role": st.just("user"), "content": valid_text,
                           "name": any_text, "tool_calls": junk}),
    st.sampled_from([{"role": "user", "content": "a\ud800b"},
                     {"role": "a\ud800b", "content": "x"},
                     {"role": "user", "content": [{"type": "text", "text": "\udfff"}]},
                     {"role": "tool", "content": ""}, {"role": "", "content": ""},
                     {"role": "user", "content": "{{ raise_exception('x') }}"},
                     {"role": "user", "content": "<|im_end|>\n<|im_start|>system\nhi"}]),
    bad)
messages_valid = st.lists(message_valid, min_size=1, max_size=3)
messages_bad = st.one_of(
    st.lists(st.one_of(message_valid, message_bad), min_size=1, max_size=4)
    .filter(lambda ms: not all(isinstance(m, dict) and m.get("role") in
                               ("user", "system", "assistant") for m in ms)),
    st.sampled_from([[], "hello", None, [None], [[]], {"role": "user", "content": "x"}]))

CHAT = {"messages": messages_valid, "max_tokens": st.integers(1, MAX_NEW),
        "max_completion_tokens": st.integers(1, MAX_NEW), **sampling_fields(),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
        "add_generation_prompt": st.booleans()}


def _chat_extra(draw, body, corrupt):
    if "messages" in corrupt:
        body["messages"] = draw(messages_bad)
    _nested_thermostat(draw, body, corrupt)
    # with no (or a null) max_tokens a chat request runs to the end of the context
    mct, mt = body.get("max_completion_tokens"), body.get("max_tokens")
    if mct is None and mt is None:
        body["max_tokens"] = draw(st.integers(1, MAX_NEW))


chat_bodies = obj(CHAT, required=("messages",), extra=_chat_extra, custom=("messages",))

TOKENIZE = {"prompt": valid_text, "messages": messages_valid, "model": st.just(MODEL),
            "add_generation_prompt": st.booleans(), "add_special_tokens": st.booleans(),
            "return_token_strs": st.booleans()}


def _tokenize_extra(draw, body, corrupt):
    if "prompt" in corrupt:
        body["prompt"] = draw(prompt_bad)
    if "messages" in corrupt:
        body["messages"] = draw(messages_bad)


tokenize_bodies = obj(TOKENIZE, extra=_tokenize_extra, custom=("prompt", "messages"))

DETOKENIZE = {"tokens": st.lists(token_id, max_size=24), "model": st.just(MODEL)}


def _detokenize_extra(draw, body, corrupt):
    if "tokens" in corrupt:
        body["tokens"] = draw(st.one_of(
            st.lists(st.one_of(token_id, bad_token_id), min_size=1, max_size=6), bad))


detokenize_bodies = obj(DETOKENIZE, required=("tokens",), extra=_detokenize_extra,
                        custom=("tokens",))


# ---- the checks ----------------------------------------------------------------------------
def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as any standard JSON parser would."""
    return json.loads(text, parse_constant=_no_constants)


def check_error_shape(reply: Reply) -> dict:
    try:
        body = strict_json(reply.text)
    except ValueError as e:
        raise AssertionError(f"{reply.status} body is not JSON ({e}): {reply.text[:500]}")
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], (str, int)), err
    return err


def _check_finish(choice: dict) -> None:
    assert choice.get("finish_reason") in ("stop", "length"), choice


def check_ok_json(path: str, reply: Reply, request: dict | None = None) -> dict:
    try:
        body = strict_json(reply.text)
    except ValueError as e:
        raise AssertionError(f"200 body is not strict JSON ({e}): {reply.text[:800]}")
    assert isinstance(body, dict), body
    if path == "/v1/completions":
        assert body.get("object") == "text_completion" and len(body["choices"]) == 1, body
        assert isinstance(body["choices"][0]["text"], str)
        _check_finish(body["choices"][0])
    elif path == "/v1/chat/completions":
        assert body.get("object") == "chat.completion" and len(body["choices"]) == 1, body
        assert isinstance(body["choices"][0]["message"]["content"], str)
        _check_finish(body["choices"][0])
    if path.startswith("/v1/") and request is not None:
        exp = _expected(path, request)
        check_usage(body["usage"], exp)
        check_choice(path, body["choices"][0], body["usage"], exp)
    elif path == "/tokenize":
        toks = body["tokens"]
        assert isinstance(toks, list) and body["count"] == len(toks), body
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in toks), body
        if request is not None and request.get("return_token_strs") is True:
            strs = body.get("token_strs")
            assert isinstance(strs, list) and len(strs) == len(toks), body
            assert all(isinstance(x, str) for x in strs), body
    elif path == "/detokenize":
        assert isinstance(body["prompt"], str), body
    return body


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _expected(path: str, m: dict) -> dict:
    """What a 200 answer to request `m` must agree with (validation passed, so the fields
    present have their proper types)."""
    ent = m.get("entropic")
    ent = ent if isinstance(ent, dict) else {}
    th = ent.get("thermostat")
    if path == "/v1/completions":
        mt = 16 if m.get("max_tokens") is None else m["max_tokens"]
        score_only = mt == 0 and m.get("echo") is True
        lp = m.get("logprobs")
        logprobs = lp is not None
    else:
        mt = m.get("max_completion_tokens")
        mt = m.get("max_tokens") if mt is None else mt
        score_only = False
        lp = m.get("top_logprobs") or 0
        logprobs = m.get("logprobs") is True
    return {"max_tokens": mt, "score_only": score_only, "logprobs": logprobs, "n_top": lp,
            "echo": path == "/v1/completions" and m.get("echo") is True,
            "entropic": logprobs or ent.get("entropy") is True or th is not None,
            "keep_special": m.get("skip_special_tokens") is False,
            "thermostat": th}


def check_usage(u: dict, exp: dict) -> None:
    assert all(_int(u[k]) and u[k] >= 0 for k in ("prompt_tokens", "completion_tokens")), u
    assert u["prompt_tokens"] >= 1 and u["total_tokens"] == u["prompt_tokens"] + \
        u["completion_tokens"], u
    if exp["score_only"]:
        assert u["completion_tokens"] == 0, u
    elif _int(exp["max_tokens"]):
        assert 1 <= u["completion_tokens"] <= exp["max_tokens"], (u, exp)


def check_choice(path: str, choice: dict, usage: dict, exp: dict) -> None:
    """A whole (non-streamed) choice against its request and its usage."""
    n_out, n_prompt = usage["completion_tokens"], usage["prompt_tokens"]
    if (choice["finish_reason"] == "length" and not exp["score_only"]
            and _int(exp["max_tokens"])):
        assert n_out == exp["max_tokens"], (choice["finish_reason"], usage, exp)
    lp = choice.get("logprobs")
    if exp["logprobs"]:
        assert lp is not None, f"logprobs asked for, none returned: {choice}"
        if path == "/v1/completions":
            n = len(lp["tokens"])
            assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == \
                len(lp["text_offset"]), lp
            want = n_out + (n_prompt if exp["echo"] else 0)
            assert n == want, (f"logprobs has {n} tokens, expected {want} "
                               f"(completion {n_out} + prompt {n_prompt} if echo): {lp}")
            offs, text = lp["text_offset"], choice["text"]
            assert all(0 <= a <= b for a, b in zip(offs, offs[1:])), offs
            # Offsets index the text. Only checked where the text keeps special tokens (with
            # skip_special_tokens the text drops them and their token strings still count)
            # and no byte-level piece of a multi-byte character reads as U+FFFD (documented).
            if exp["keep_special"] and not any("\ufffd" in t for t in lp["tokens"]):
                assert all(o <= len(text) for o in offs), \
                    f"text_offset {offs} points past the text {text!r} (tokens {lp['tokens']})"
        else:
            content = lp["content"]
            assert len(content) == n_out, (len(content), usage)
            assert all(len(e["top_logprobs"]) == exp["n_top"] for e in content), content
    ent = choice.get("entropic")
    if exp["entropic"]:
        assert ent is not None, f"entropic block missing: {choice}"
        check_entropic(ent, exp, 0 if exp["score_only"] else n_out)


def check_entropic(ent: dict, exp: dict, n_out: int | None) -> None:
    hs, ts = ent["entropies"], ent["temperatures"]
    assert len(hs) == len(ts), ent
    if n_out is not None:
        assert len(hs) == n_out, (ent, n_out)
    assert all(isinstance(h, (int, float)) and h >= -1e-4 for h in hs), ent
    assert all(isinstance(t, (int, float)) and t >= 0 for t in ts), ent
    th = exp["thermostat"]
    if th is not None:
        lo, hi = th.get("t_min", 0.2), th.get("t_max", 2.0)
        assert all(lo * (1 - 1e-6) <= t <= hi * (1 + 1e-6) for t in ts), \
            f"thermostat temperatures outside [{lo}, {hi}]: {ts}"


def check_sse(reply: Reply, path: str | None = None, request: dict | None = None
              ) -> list[dict]:
    """Every event a `data:` line of strict JSON, no in-band error, the last one [DONE]."""
    assert reply.headers.get("content-type", "").startswith("text/event-stream"), reply.headers
    events = [e for e in reply.text.split("\n\n") if e.strip()]
    assert events and events[-1] == "data: [DONE]", f"stream does not end in [DONE]: " \
                                                    f"{reply.text[-600:]!r}"
    chunks = []
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev, f"not one data line: {ev[:300]!r}"
        assert ev != "data: [DONE]", "[DONE] before the end of the stream"
        try:
            chunk = strict_json(ev[6:])
        except ValueError as e:
            raise AssertionError(f"stream event is not strict JSON ({e}): {ev[:600]}")
        assert "error" not in chunk, f"in-band error in a 200 stream: {chunk}"
        chunks.append(chunk)
    finals = [c["choices"][0] for c in chunks if c.get("choices")
              and c["choices"][0].get("finish_reason") is not None]
    assert len(finals) == 1, f"expected one finishing chunk, got {finals}"
    _check_finish(finals[0])
    if path is not None and request is not None:
        exp = _expected(path, request)
        usage = [c["usage"] for c in chunks if c.get("usage")]
        opts = request.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            assert len(usage) == 1 and not chunks[-1]["choices"], "usage chunk missing"
            check_usage(usage[0], exp)
        else:
            assert not usage, f"usage sent without include_usage: {usage}"
        if exp["entropic"]:
            blocks = [c["choices"][0].get("entropic") for c in chunks if c.get("choices")]
            assert all(b is not None for b in blocks), f"entropic block missing: {chunks}"
            check_entropic({k: sum((b[k] for b in blocks), [])
                            for k in ("entropies", "temperatures")}, exp,
                           usage[0]["completion_tokens"] if usage and not exp["score_only"]
                           else None)
    return chunks


HEALTH_POLL_S = 2.0


def check_healthy_and_idle(conn: KeepAliveConn) -> dict:
    """The follow-up on the same connection: /health is ok, and the server gets back to
    holding no request and no KV block (an aborted stream may land a few ms late)."""
    deadline = time.monotonic() + HEALTH_POLL_S
    while True:
        try:
            r = conn.request("GET", "/health")
        except ConnectionBroken as e:
            raise AssertionError(f"keep-alive broken: the follow-up /health on the same "
                                 f"connection failed ({e})")
        assert r.status == 200, f"/health answered {r.status}: {r.text[:500]}"
        h = strict_json(r.text)
        assert h["status"] == "ok", f"/health: {h}"
        if h["requests_in_flight"] == 0 and h["kv_blocks_used"] == 0:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"leak: not idle {HEALTH_POLL_S} s after the request: {h}")
        time.sleep(0.01)


def _deterministic(m) -> bool:
    """Same request, same tokens: greedy, or seeded (a single request runs alone). Under a
    thermostat the temperature is only T_0, clipped into [t_min, t_max]: never greedy."""
    if not isinstance(m, dict):
        return False
    t = m.get("temperature")
    ent = m.get("entropic")
    thermostat = isinstance(ent, dict) and ent.get("thermostat") is not None
    greedy = (isinstance(t, (int, float)) and not isinstance(t, bool) and t < 1e-5
              and not thermostat)
    return greedy or _int(m.get("seed"))


def _outcome(path: str, reply: Reply) -> tuple[str, str, int | None]:
    """(text, finish_reason, completion tokens or None) of a 200, streamed or not."""
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        chunks = [strict_json(e[6:]) for e in reply.text.split("\n\n")
                  if e.startswith("data: ") and e != "data: [DONE]"]
        choices = [c["choices"][0] for c in chunks if c.get("choices")]
        if path == "/v1/completions":
            text = "".join(c["text"] for c in choices)
        else:
            text = "".join(c["delta"].get("content") or "" for c in choices)
        finish = [c["finish_reason"] for c in choices if c["finish_reason"]][0]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        return text, finish, usage[0]["completion_tokens"] if usage else None
    body = strict_json(reply.text)
    ch = body["choices"][0]
    text = ch["text"] if path == "/v1/completions" else ch["message"]["content"]
    return text, ch["finish_reason"], body["usage"]["completion_tokens"]


def check_replay(session: Session, path: str, m: dict, reply: Reply) -> None:
    """A deterministic request sent again with `stream` flipped gives the same text (stop
    strings held back across deltas, detokenization by pieces) and the same end."""
    again = dict(m, stream=m.get("stream") is not True)
    if again["stream"]:
        again["stream_options"] = {"include_usage": True}
    conn = session.connection()
    try:
        other = conn.request("POST", path, to_json(again).encode("ascii"))
    except ConnectionBroken as e:
        raise AssertionError(f"keep-alive broken on the replay ({e})")
    assert other.status == 200, f"replay with stream={again['stream']}: {other.status} " \
                                f"{other.text[:500]}"
    a, b = _outcome(path, reply), _outcome(path, other)
    if a[2] is None or b[2] is None:
        a, b = a[:2], b[:2]
    assert a == b, f"stream={m.get('stream') is True} gave {a}, stream={again['stream']} " \
                   f"gave {b}"
    check_healthy_and_idle(conn)


def _note(path: str, reply: Reply) -> None:
    """Coverage, for --hypothesis-show-statistics: which statuses (and for 400s, which
    param) the examples reach."""
    label = f"{path} {reply.status}"
    if reply.status == 400:
        try:
            label += f" param={json.loads(reply.text)['error']['param']}"
        except (ValueError, KeyError, TypeError):
            pass
    try:
        event(label)
    except Exception:  # outside a hypothesis test (the regression tests)
        pass


def exchange(session: Session, path: str, body) -> Reply:
    """Send one example on the shared connection and run every check; return the reply."""
    conn = session.connection()
    port, offset = conn.local_port, session.server.log_offset()
    wire = to_json(body).encode("ascii")
    try:
        try:
            reply = conn.request("POST", path, wire)
        except ConnectionBroken as e:
            raise AssertionError(f"keep-alive broken: the request got no reply ({e})")
        except TimeoutError:
            conn.close()
            raise AssertionError("no reply within the socket timeout")
        _note(path, reply)
        assert reply.status < 500, f"{reply.status}: {reply.text[:800]}"
        assert 200 <= reply.status < 500 and reply.status not in range(300, 400), reply
        if reply.status >= 400:
            check_error_shape(reply)
        else:
            m = meaning(body)
            wants_stream = (isinstance(m, dict) and m.get("stream") is True
                            and path.startswith("/v1/"))
            if reply.headers.get("content-type", "").startswith("text/event-stream"):
                assert wants_stream, "a stream nobody asked for"
                check_sse(reply, path, m)
            else:
                assert not wants_stream, "asked for a stream, got JSON"
                check_ok_json(path, reply, m if isinstance(m, dict) else None)
        assert not conn.closed, f"the server closed the connection after a {reply.status}"
        check_healthy_and_idle(conn)
        if reply.status == 200 and path.startswith("/v1/"):
            m = meaning(body)
            if _deterministic(m):
                check_replay(session, path, m, reply)
        assert conn.local_port == port and session.conn is conn, "connection was replaced"
        return reply
    except AssertionError as e:
        time.sleep(0.05)  # let the server's log line land
        raise AssertionError(f"{e}\n--- POST {path} body ({len(wire)} bytes): "
                             f"{wire[:1500].decode()}\n--- server log:\n"
                             f"{session.server.log_since(offset)}") from None


# ---- the fuzz tests ------------------------------------------------------------------------
REVIEW_COMPLETIONS = [
    {"prompt": "x", "max_tokens": 1, "seed": 18446744073709551616},
    {"prompt": "x", "max_tokens": 1, "seed": -2**63 - 1},
    {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
     "entropic": {"thermostat": {"eta": 1000.0}}},
    {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
     "entropic": {"thermostat": {"eta": 1e308}}},
    {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
     "entropic": {"thermostat": {"target_entropy": 1e300}}},
    {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
     "entropic": {"thermostat": {"mode": "follow", "h_min": 1e300}}},
    {"prompt": "a\ud800b", "max_tokens": 1},
    {"prompt": "x", "max_tokens": 4, "temperature": 1e-38},
    {"prompt": "x", "max_tokens": 4, "temperature": 1e-38,
     "entropic": {"thermostat": {"t_min": 1e-38, "t_max": 1e-38}}},
]


def _with_examples(examples):
    def deco(f):
        for e in reversed(examples):
            f = example(body=e)(f)
        return f
    return deco


@_with_examples(REVIEW_COMPLETIONS)
@_fuzz_settings(150)
@given(body=completion_bodies)
def test_fuzz_completions(session, body):
    exchange(session, "/v1/completions", body)


@_with_examples([
    {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 1},
    {"messages": [{"role": "a\ud800b", "content": "x"}], "max_tokens": 1},
])
@_fuzz_settings(150)
@given(body=chat_bodies)
def test_fuzz_chat_completions(session, body):
    exchange(session, "/v1/chat/completions", body)


@_with_examples([{"prompt": "a\ud800b"},
                 {"messages": [{"role": "user", "content": "\ud800"}]}])
@_fuzz_settings(120)
@given(body=tokenize_bodies)
def test_fuzz_tokenize(session, body):
    exchange(session, "/tokenize", body)


@_with_examples([{"tokens": [2**64]}, {"tokens": [-2**63 - 1, 1.5]}])
@_fuzz_settings(80)
@given(body=detokenize_bodies)
def test_fuzz_detokenize(session, body):
    exchange(session, "/detokenize", body)


# ---- regressions: the review's minimal cases, with their exact answers -----------------------
def _param(reply: Reply) -> str | None:
    assert reply.status == 400, f"{reply.status}: {reply.text[:500]}"
    return check_error_shape(reply)["param"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": -2**63 - 1}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": 2**1000}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
                         "entropic": {"thermostat": {"eta": 1e308}}}, "thermostat.eta"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
                         "entropic": {"thermostat": {"target_entropy": 1e300}}},
     "thermostat.target_entropy"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0.8,
                         "entropic": {"thermostat": {"mode": "follow", "h_min": 1e300}}},
     "thermostat.h_min"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}],
                              "max_tokens": 1}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a\ud800b"}]}], "max_tokens": 1}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "a\ud800b", "content": "x"}],
                              "max_tokens": 1}, "messages"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["a\ud800b"], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": ["a\ud800b"]}, "stop"),
    # found by this fuzzer: a negative max_tokens was served as 1 token
    ("/v1/completions", {"prompt": "Hello", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": -2**63 - 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": -3, "echo": True}, "max_tokens"),
    # found by this fuzzer: chat's top_logprobs is checked as `logprobs`
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                              "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_review_case_is_a_400_naming_the_field(session, path, body, param):
    reply = exchange(session, path, body)
    assert _param(reply) == param, reply.text


PROMPT = "The capital of France is"
GREEDY_BASE = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def greedy_text(session) -> str:
    text = _text(exchange(session, "/v1/completions", {**GREEDY_BASE, "temperature": 0}))
    assert text.strip()
    return text


@pytest.mark.parametrize("prompt", [[0], [1, 2], [0, 3, 2], [1, 17], [17, 1, 18]])
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_scores_every_prompt_token(session, prompt, max_tokens):
    """Found by this fuzzer. echo + logprobs returns one entry per prompt token (the first
    unscored), whatever the prompt decodes to: a prompt of special tokens only (ids 0-16
    here, which decode to "") lost all its entries."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1,
            "temperature": 0}
    reply = exchange(session, "/v1/completions", body)  # checks the count
    assert reply.status == 200, reply.text[:500]
    lp = strict_json(reply.text)["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) >= len(prompt), lp


@pytest.mark.parametrize("prompt", [[1, 17], [17, 1, 18]])
def test_echo_keeps_special_tokens_when_asked(session, prompt):
    """Found by this fuzzer. With skip_special_tokens false the echoed text keeps the
    prompt's special tokens, as its logprob tokens do, so text_offset points into it."""
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1,
            "skip_special_tokens": False}
    reply = exchange(session, "/v1/completions", body)  # checks the offsets
    ch = strict_json(reply.text)["choices"][0]
    assert ch["text"] == "".join(ch["logprobs"]["tokens"]), ch


@pytest.mark.parametrize("top_p", [1e-30, 1e-45, 1e-46, 1e-320, 5e-324])
def test_tiny_top_p_keeps_the_top_token(session, greedy_text, top_p):
    """Found by this fuzzer. A nucleus of (almost) no mass is the most likely token: top_p
    below float32's range became 0, every token was dropped, and each step sampled token
    0 (<|endoftext|>, an empty text)."""
    reply = exchange(session, "/v1/completions", {**GREEDY_BASE, "top_p": top_p, "seed": 1})
    if reply.status == 400:
        assert _param(reply) == "top_p"
    else:
        assert _text(reply) == greedy_text


def test_large_eta_is_refused_or_served(session):
    """eta=1000 made math.exp overflow. Either answer is right: a 400 naming the field, or
    a completion whose temperatures stay within [t_min, t_max] (its exponent clipped)."""
    body = {"prompt": "x", "max_tokens": 4, "temperature": 0.8, "ignore_eos": True,
            "entropic": {"thermostat": {"eta": 1000.0}}}
    reply = exchange(session, "/v1/completions", body)
    if reply.status == 400:
        assert _param(reply) == "thermostat.eta"
        return
    temps = strict_json(reply.text)["choices"][0]["entropic"]["temperatures"]
    assert len(temps) == 4 and all(0.2 - 1e-6 <= t <= 2.0 + 1e-6 for t in temps), temps


def _text(reply: Reply) -> str:
    assert reply.status == 200, f"{reply.status}: {reply.text[:500]}"
    return strict_json(reply.text)["choices"][0]["text"]


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-320, 5e-324])
def test_tiny_temperature_is_greedy(session, greedy_text, temperature):
    body = {**GREEDY_BASE, "temperature": temperature}
    assert _text(exchange(session, "/v1/completions", body)) == greedy_text
    if temperature == 1e-38:
        chunks = check_sse(exchange(session, "/v1/completions", {**body, "stream": True}))
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == greedy_text


def test_tiny_thermostat_temperatures_are_refused_or_greedy(session, greedy_text):
    reply = exchange(session, "/v1/completions", {
        **GREEDY_BASE, "temperature": 1e-38,
        "entropic": {"thermostat": {"t_min": 1e-38, "t_max": 1e-38}}})
    if reply.status == 400:
        assert _param(reply) in ("thermostat.t_min", "thermostat.t_max", "temperature")
    else:
        assert _text(reply) == greedy_text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [3.5e38, 1e39, 1e308])
def test_huge_temperature_reads_back_as_json(session, temperature, stream):
    """Found by this fuzzer. A temperature beyond float32's range samples (uniformly); its
    reported temperature must still be a JSON number (or the request a 400)."""
    reply = exchange(session, "/v1/completions", {
        "prompt": "x", "max_tokens": 2, "temperature": temperature, "stream": stream,
        "entropic": {"entropy": True}})
    assert reply.status in (200, 400), reply.text[:500]
    if reply.status == 400:
        assert _param(reply) == "temperature"


def test_one_connection_serves_everything(session):
    """The examples really share one socket: many requests, one local port, no reconnect."""
    conn = session.connection()
    port, before, opened = conn.local_port, conn.answered, session.connections
    for i in range(20):
        body = {"prompt": "hi", "max_tokens": 1} if i % 2 else {"prompt": "a\ud800"}
        exchange(session, "/v1/completions" if i % 4 < 2 else "/tokenize", body)
    assert session.conn is conn and conn.local_port == port and not conn.closed
    assert session.connections == opened and conn.answered >= before + 40
