"""An asyncio front over LLMEngine: one engine loop, in one thread, for every request.

The engine is not thread-safe, so exactly one thread owns it. Request handlers (on the
event loop) send it commands through a thread-safe queue (add, abort); the thread applies
them between steps, runs `engine.step()` while any request is unfinished (all concurrent
requests share each step: that is the continuous batching), and hands every output to its
request's asyncio queue with `loop.call_soon_threadsafe`. torch releases the GIL inside its
kernels, so the event loop keeps serving HTTP while a step runs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from entropic.engine.engine import LLMEngine
from entropic.outputs import RequestOutput
from entropic.sampling_params import SamplingParams

log = logging.getLogger("entropic.server")


class QueueFullError(RuntimeError):
    """The server already holds its maximum number of requests (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or was stopped (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (finish_reason "error"); it goes on serving the
    others (HTTP 500 for this request only)."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges read by /health and /metrics; replaced whole (never mutated) by the
    engine thread after each step or command, so readers on other threads see a consistent
    set without a lock."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


_STOP = object()

StepHook = Callable[[LLMEngine, list[RequestOutput]], None]
FatalHook = Callable[[BaseException], None]


class AsyncEngine:
    """Owns the engine thread. `submit()` hands it a request and returns its stream.

    At most `max_num_seqs + max_waiting` requests are held at once (running in the engine,
    waiting in it, or on their way in); one more gets QueueFullError. `on_step` (optional)
    is called on the engine thread after every step with that step's outputs (metrics);
    `on_fatal` (optional) once, on the engine thread, if the loop itself dies (a bug outside
    any one request): the server uses it to exit non-zero so that a supervisor restarts it."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 on_step: StepHook | None = None, on_fatal: FatalHook | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_waiting
        self.num_in_flight = 0  # touched on the event loop only
        self.snapshot = EngineSnapshot(kv_blocks_total=engine.num_blocks)
        self._on_step = on_step
        self._on_fatal = on_fatal
        self._cmds: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="entropic-engine", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop after the current step; requests still held are aborted."""
        if self._thread.is_alive():
            self._cmds.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """What killed the engine loop, if it died."""
        return self._error

    # ---- the request side (event loop) --------------------------------------------------
    def validate(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The engine's own checks (context length, token ids, KV capacity); they read only
        immutable state, so they run here and a bad request never reaches the thread."""
        return self.engine.validate(prompt, params)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               arrival_time: float | None = None) -> "RequestStream":
        """Hand a validated request to the engine loop; iterate the returned stream for its
        outputs. Raises QueueFullError when the server is full, EngineDeadError when the
        loop is not running. Call `close()` on the stream when done with it (closing one
        that has not finished aborts the request and frees its KV blocks)."""
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        if self.num_in_flight >= self.capacity:
            raise QueueFullError(
                f"the server is full: {self.num_in_flight} requests held (max_num_seqs + "
                f"max_waiting = {self.capacity}); retry later")
        self.num_in_flight += 1
        sink: asyncio.Queue = asyncio.Queue()
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self._cmds.put(_Add(request_id, prompt_ids, params, arrival,
                            asyncio.get_running_loop(), sink))
        return RequestStream(self, request_id, sink)

    def _release(self, request_id: str, abort: bool) -> None:
        self.num_in_flight -= 1
        if abort:
            self._cmds.put(_Abort(request_id))

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                # Block only when idle; otherwise take whatever arrived during the last step.
                idle = not eng.has_unfinished_requests()
                cmds = [self._cmds.get()] if idle else []
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _STOP for c in cmds):
                    break
                for c in cmds:
                    self._apply(c)
                outs = eng.step() if eng.has_unfinished_requests() else []
                for out in outs:
                    self._deliver(out)
                if self._on_step is not None and outs:
                    try:
                        self._on_step(eng, outs)
                    except Exception:  # a metrics bug must not stop serving
                        log.exception("on_step hook failed")
                self._publish()
        except BaseException as e:  # a bug outside any one request: fail all, loudly
            log.exception("engine loop failed")
            self._error = e
            err = EngineDeadError(f"engine failure: {type(e).__name__}: {e}")
            for rid in list(self._sinks):
                self._send(rid, err)
                self._sinks.pop(rid, None)
            if self._on_fatal is not None:
                self._on_fatal(e)
            return
        for rid in list(self._sinks):  # stopped: nobody will step these any more
            eng.abort_request(rid)
            self._send(rid, EngineDeadError("the server is shutting down"))
        self._sinks.clear()
        self._publish()

    def _apply(self, c) -> None:
        if isinstance(c, _Add):
            try:
                self.engine.add_request(c.request_id, c.prompt_ids, c.params, c.arrival_time)
            except (ValueError, TypeError) as e:
                _post((c.loop, c.sink), e)
                return
            except Exception as e:  # not the request's fault, but it alone is lost
                log.exception("adding request %s failed", c.request_id)
                _post((c.loop, c.sink), RequestFailedError(
                    f"the engine could not add this request: {type(e).__name__}: {e}"))
                return
            self._sinks[c.request_id] = (c.loop, c.sink)
        elif isinstance(c, _Abort):
            # The client is gone: nobody reads the abort output.
            if self._sinks.pop(c.request_id, None) is not None:
                self.engine.abort_request(c.request_id)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            target = self._sinks.pop(out.request_id, None)
        else:
            target = self._sinks.get(out.request_id)
        if target is not None:
            if out.finish_reason == "error":
                _post(target, RequestFailedError(f"the engine failed this request: {out.error}"))
            else:
                _post(target, out)

    def _send(self, rid: str, item) -> None:
        target = self._sinks.get(rid)
        if target is not None:
            _post(target, item)

    def _publish(self) -> None:
        s = self.engine.scheduler
        self.snapshot = EngineSnapshot(
            running=len(s.running), waiting=len(s.waiting),
            kv_blocks_used=self.engine.pool.num_used,
            kv_blocks_total=self.engine.pool.num_blocks, steps=self.engine.stats.steps)


def _post(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    """Put `item` on a request's queue from the engine thread."""
    loop, sink = target
    try:
        loop.call_soon_threadsafe(sink.put_nowait, item)
    except RuntimeError:  # its event loop is closed (shutdown): nobody is listening
        pass


class RequestStream:
    """Async iterator over one request's outputs (the last one has `finished` set).

    Cancelling a task that awaits it (a client that disconnects) or calling `close()`
    before the end aborts the request in the engine."""

    def __init__(self, owner: AsyncEngine, request_id: str, sink: asyncio.Queue) -> None:
        self.request_id = request_id
        self._owner = owner
        self._sink = sink
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._sink.get()
        except BaseException:  # cancelled while waiting: the client is gone
            self.close()
            raise
        if isinstance(item, BaseException):  # the engine side has already dropped it
            self._finish(abort=False)
            raise item
        if item.finished:
            self._finish(abort=False)
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; idempotent."""
        self._finish(abort=True)

    def _finish(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._owner._release(self.request_id, abort)
