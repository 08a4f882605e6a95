"""A real `entropic serve` process on 127.0.0.1 for tests: start, wait until healthy, read
its log, stop."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m entropic.cli serve --port P *args` (or `script serve ...`), its output in
    a temporary log. `start()` returns once /health answers 200; raises RuntimeError with
    the log's tail if the process exits or does not become healthy in `timeout` s."""

    def __init__(self, *args: str, script: str | None = None, timeout: float = 180.0) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        entry = [script] if script else ["-m", "entropic.cli"]
        self.cmd = [sys.executable, *entry, "serve", "--port", str(self.port), *args]
        self.timeout = timeout
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not healthy in {self.timeout:.0f} s:\n"
                                   f"{self.log_text()[-3000:]}")
            time.sleep(0.3)

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

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

    def __enter__(self) -> "ServerProcess":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
