"""`entropic serve`: its command-line options and the uvicorn launch.

Kept apart from cli.py so that the shared CLI file only gains a few lines, and so that
`entropic generate` never imports FastAPI.
"""
from __future__ import annotations

import argparse
import os
import sys

from entropic.cli_args import add_load_args, load_kwargs, loaded_line
from entropic.speculative.config import add_speculative_args

API_KEY_ENV = "ENTROPIC_API_KEY"
# After the engine loop dies the server answers for this long (503s, /health saying why)
# before it exits 1, so that a probe or a person reading /health sees the cause.
FATAL_EXIT_DELAY_S = 2.0
SWITCH_INTERVAL_S = 0.0005  # the GIL switch interval of the server process


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p)
    p.add_argument("--served-model-name", default=None,
                   help="the `model` name clients use (default: the checkpoint's file name)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: local clients only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                        f"(visible in `ps`: prefer ${API_KEY_ENV} or --api-key-file)")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (its first line)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="put /metrics and /health behind the API key too (default: open, "
                        "for probes and scrapers)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve /docs and /openapi.json (behind the API key when one is set)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="reject larger request bodies with 413 (default: 128 bytes per "
                        "token of context, at least 1 MiB)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated names accepted in the Host header, '*' for any "
                        "(default: the loopback names when bound to loopback, which stops DNS "
                        "rebinding; any otherwise)")
    p.add_argument("--no-ui", dest="ui", action="store_false",
                   help="do not serve the entropy lens web page at / (docs/lens.md)")
    p.add_argument("--timeout-header", type=float, default=10.0,
                   help="close connections that take longer to send request headers (s)")
    p.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="close idle keep-alive connections after this many seconds")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests held beyond --max-num-seqs before answering 429 (default 256)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="running batch size (slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache size in GiB when --num-kv-blocks is not given")
    p.add_argument("--scheduling", choices=("fcfs", "entropic"), default="fcfs",
                   help="request ordering: fcfs, or entropic (priority with aging)")
    p.add_argument("--pruning", action="store_true",
                   help="entropic KV-block pruning in decode attention (default PruningConfig)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_speculative_args(p)
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))


def api_key_from(args: argparse.Namespace, environ=os.environ) -> str | None:
    """The key from --api-key, --api-key-file or $ENTROPIC_API_KEY (at most one of them);
    None when none is given. An empty key is an error, never "no auth"."""
    given = [(name, v) for name, v in (("--api-key", args.api_key),
                                       ("--api-key-file", args.api_key_file),
                                       (f"${API_KEY_ENV}", environ.get(API_KEY_ENV)))
             if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"api key: give one of {', '.join(n for n, _ in given)}, not several")
    name, value = given[0]
    if name == "--api-key-file":
        try:
            with open(value, encoding="utf-8") as f:
                value = f.readline()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {value!r}: {e.strerror}") from None
    value = value.strip()
    if not value:
        raise ValueError(f"{name}: the API key is empty; omit it to serve without a key")
    return value


def allowed_hosts(given: str | None, bind_host: str, default) -> frozenset[str] | None:
    """--allowed-hosts as a set of names (None: any Host), or the default for `bind_host`."""
    if given is None:
        return default(bind_host)
    names = frozenset(n.strip().lower() for n in given.split(",") if n.strip())
    if not names:
        raise ValueError("--allowed-hosts: give at least one name, or '*' for any")
    return None if "*" in names else names


def page_url(host: str, port: int) -> str:
    """The address to open the page at: a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "[::1]"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted. Exits 1 if the engine loop dies, so a
    supervisor restarts the server instead of it answering 503 for ever."""
    import asyncio

    import torch
    import uvicorn

    from entropic import LLM
    from entropic.control.pruning import PruningConfig
    from entropic.server.app import ServerOptions, build_app, default_allowed_hosts
    from entropic.server.transport import header_timeout_protocol

    options = ServerOptions(model_name=args.served_model_name, api_key=api_key_from(args),
                            max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                            protect_metrics=args.protect_metrics, enable_docs=args.enable_docs,
                            ui=args.ui,
                            allowed_hosts=allowed_hosts(args.allowed_hosts, args.host,
                                                        default_allowed_hosts))
    protocol = header_timeout_protocol(args.timeout_header)
    # Three kinds of threads share the GIL here: the event loop, the engine (which gives it
    # up around every torch op and must take it back) and workers tokenizing or encoding
    # large bodies. While a worker computes, each take-back waits up to the switch interval;
    # at the default 5 ms that stretched a decode step of other clients' streams by ~0.1 s.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("loading model ...", file=sys.stderr, flush=True)
    llm = LLM(**load_kwargs(args), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size,
              num_kv_blocks=args.num_kv_blocks, kv_cache_gib=args.kv_cache_gib,
              scheduling=args.scheduling,
              pruning=PruningConfig() if args.pruning else None)
    print(loaded_line(llm), file=sys.stderr, flush=True)

    failed: list[BaseException] = []
    server: uvicorn.Server | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def on_fatal(e: BaseException) -> None:  # on the engine thread
        failed.append(e)
        print(f"error: the engine loop died ({type(e).__name__}: {e}); shutting down",
              file=sys.stderr, flush=True)
        if loop is not None and server is not None:  # /health says why meanwhile
            loop.call_soon_threadsafe(loop.call_later, FATAL_EXIT_DELAY_S, setattr, server,
                                      "should_exit", True)

    app = build_app(llm, options, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            http=protocol, timeout_keep_alive=args.timeout_keep_alive,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def announce() -> None:
        """Once the port is bound, say where the page is (uvicorn's own line names the
        bind address, which for 0.0.0.0 is not one to open)."""
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.05)
        url = page_url(args.host, args.port)
        what = (f"entropy lens (web UI): open {url} in a browser" if args.ui
                else f"serving the API at {url}v1 (web UI off: --no-ui)")
        print(what, file=sys.stderr, flush=True)

    async def main() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        shout = asyncio.ensure_future(announce())
        try:
            await server.serve()
        finally:
            shout.cancel()

    asyncio.run(main())
    return 1 if failed else 0
