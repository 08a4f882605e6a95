"""The server's guards, with no model: JSON 500s that keep the connection, the body-size
limit, the header timeout, the API key's sources and scope. Served by a real uvicorn on
127.0.0.1, on the same protocol class `entropic serve` runs. Last, with the real model:
a server whose engine loop dies says so on /health and exits non-zero."""
from __future__ import annotations

import argparse
import json
import socket
import textwrap
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from entropic.server.app import ServerOptions, default_allowed_hosts
from entropic.server.errors import (ApiKeyGate, BodyLimit, ContainErrors,
                                    install_error_handlers)
from entropic.server.launch import API_KEY_ENV, allowed_hosts, api_key_from
from entropic.server.transport import header_timeout_protocol
from serving import ServerProcess, free_port

LIMIT = 4096
HEADER_TIMEOUT = 0.5


def _tiny_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.get("/crash")
    async def crash() -> dict:
        raise KeyError("a bug in a handler")

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    app.add_middleware(ContainErrors)
    app.add_middleware(BodyLimit, max_bytes=LIMIT)
    app.add_middleware(ApiKeyGate, api_key="k", prefixes=("/echo",))
    return app


@pytest.fixture(scope="module")
def base():
    port = free_port()
    config = uvicorn.Config(_tiny_app(), host="127.0.0.1", port=port, log_level="critical",
                            http=header_timeout_protocol(HEADER_TIMEOUT))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", port
    server.should_exit = True
    thread.join(5)


def _request(sock: socket.socket, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send one HTTP/1.1 request on `sock`, read one response (Content-Length framed)."""
    sock.sendall(head.encode() + b"\r\n" + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    lines = header.decode().split("\r\n")
    length = next(int(v) for k, _, v in (x.partition(": ") for x in lines[1:])
                  if k.lower() == "content-length")
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), rest[:length]


def test_handler_crash_is_json_500_and_keeps_the_connection(base):
    _, port = base
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        get = "GET {} HTTP/1.1\r\nHost: x\r\n"
        status, body = _request(sock, get.format("/crash"))
        assert status == 500
        err = json.loads(body)["error"]
        assert err["type"] == "server_error" and "KeyError" in err["message"]
        status, body = _request(sock, get.format("/ok"))  # the same connection still serves
        assert status == 200 and json.loads(body) == {"ok": True}


def test_body_limit_from_content_length_and_from_a_chunked_body(base):
    url, _ = base
    auth = {"Authorization": "Bearer k"}
    assert httpx.post(url + "/echo", content=b"x" * LIMIT, headers=auth).json() == {
        "bytes": LIMIT}
    r = httpx.post(url + "/echo", content=b"x" * (LIMIT + 1), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():
        for _ in range(8):
            yield b"y" * 1024

    r = httpx.post(url + "/echo", content=chunks(), headers=auth)  # no Content-Length
    assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"]
    # the key is checked before the body is read
    assert httpx.post(url + "/echo", content=b"x" * (LIMIT + 1)).status_code == 401


def test_slow_headers_are_cut_off_and_keep_alive_still_works(base):
    _, port = base
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        slow.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        t0 = time.perf_counter()
        assert slow.recv(1024) == b""  # closed by the server
        waited = time.perf_counter() - t0
    assert HEADER_TIMEOUT * 0.8 <= waited < HEADER_TIMEOUT + 2
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        get = "GET /ok HTTP/1.1\r\nHost: x\r\n"
        for _ in range(3):  # requests well within the timeout keep the connection
            assert _request(sock, get)[0] == 200
            time.sleep(HEADER_TIMEOUT * 0.5)
        sock.sendall(b"GET /ok HTTP/1.1\r\n")  # then a slow second request is cut off too
        assert sock.recv(1024) == b""


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"api_key": None, "api_key_file": None, **kw})


def test_api_key_sources(tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text("s3cret\n")
    assert api_key_from(_args(), {}) is None
    assert api_key_from(_args(api_key="a"), {}) == "a"
    assert api_key_from(_args(api_key_file=str(keyfile)), {}) == "s3cret"
    assert api_key_from(_args(), {API_KEY_ENV: "from-env"}) == "from-env"
    for args, env, words in [(_args(api_key=""), {}, "empty"),
                             (_args(api_key="  "), {}, "empty"),
                             (_args(), {API_KEY_ENV: ""}, "empty"),
                             (_args(api_key="a"), {API_KEY_ENV: "b"}, "not several"),
                             (_args(api_key_file=str(tmp_path / "none")), {}, "cannot read")]:
        with pytest.raises(ValueError, match=words):
            api_key_from(args, env)
    keyfile.write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file: the API key is empty"):
        api_key_from(_args(api_key_file=str(keyfile)), {})


def test_server_options():
    with pytest.raises(ValueError, match="api_key"):
        ServerOptions(api_key="")
    with pytest.raises(ValueError, match="protect_metrics"):
        ServerOptions(protect_metrics=True)
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServerOptions(max_body_bytes=10)
    opts = ServerOptions(api_key="k")
    assert "/metrics" not in opts.guarded_prefixes() and "/v1" in opts.guarded_prefixes()
    guarded = ServerOptions(api_key="k", protect_metrics=True, enable_docs=True)
    assert {"/metrics", "/health", "/docs", "/openapi.json"} <= set(guarded.guarded_prefixes())
    assert opts.body_limit(8192) == 1 << 20 and opts.body_limit(32768) == 128 * 32768
    assert ServerOptions(max_body_bytes=5000).body_limit(8192) == 5000


def test_allowed_hosts():
    loopback = default_allowed_hosts("127.0.0.1")
    assert {"localhost", "127.0.0.1", "[::1]"} <= loopback
    assert default_allowed_hosts("0.0.0.0") is None
    assert allowed_hosts(None, "127.0.0.1", default_allowed_hosts) == loopback
    assert allowed_hosts("a.example, B.example", "0.0.0.0",
                         default_allowed_hosts) == {"a.example", "b.example"}
    assert allowed_hosts("*", "127.0.0.1", default_allowed_hosts) is None
    with pytest.raises(ValueError, match="--allowed-hosts"):
        allowed_hosts(" , ", "0.0.0.0", default_allowed_hosts)


# The engine loop's death is injected from outside the product code: the script below
# patches the scheduler to raise once a request asks for max_tokens == 13.
_DYING_SERVER = textwrap.dedent("""
    import sys
    from entropic.engine.scheduler import Scheduler
    from entropic.cli import main
    real = Scheduler.schedule
    def schedule(self):
        if any(r.params.max_tokens == 13 for r in self.requests.values()):
            raise RuntimeError("injected scheduler bug")
        return real(self)
    Scheduler.schedule = schedule
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.model
def test_dead_engine_loop_reports_and_exits_nonzero(tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(_DYING_SERVER)
    with ServerProcess("--threads", "1", "--dtype", "float32", "--log-level", "warning",
                       script=str(script)) as srv:
        ok = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
        r = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 13},
                       timeout=30)
        assert r.status_code == 503 and "injected scheduler bug" in r.json()["error"]["message"]
        health = httpx.get(srv.base + "/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["status"] == "engine_failed"
        assert "injected scheduler bug" in health.json()["error"]
        assert srv.proc.wait(30) == 1
        assert "the engine loop died" in srv.log_text()
