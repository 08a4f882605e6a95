"""The server's engine loop (AsyncEngine) over a fake engine: batching, abort on close or
cancel, back-pressure, engine failure. No model, no HTTP."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from entropic.outputs import RequestOutput
from entropic.sampling_params import SamplingParams
from entropic.server.async_engine import (AsyncEngine, EngineDeadError, QueueFullError,
                                          RequestFailedError)


class FakeEngine:
    """One token per unfinished request per step; a step can be made to block or fail."""

    def __init__(self, max_num_seqs: int = 4, fail_at_step: int | None = None,
                 fail_request: str | None = None) -> None:
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.num_blocks = 100
        self.reqs: dict[str, list] = {}  # id -> [prompt, params, tokens]
        self.aborted: list[str] = []
        self.batch_sizes: list[int] = []
        self.fail_at_step = fail_at_step
        self.fail_request = fail_request  # finishes with finish_reason "error" at its 2nd token
        self.gate = threading.Event()
        self.gate.set()
        self.stats = SimpleNamespace(steps=0)
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.pool = SimpleNamespace(num_used=0, num_blocks=100)
        self.thread_ids: set[int] = set()

    def validate(self, prompt, params):
        return list(prompt)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def add_request(self, rid, prompt, params, arrival_time=None):
        self.thread_ids.add(threading.get_ident())
        self.reqs[rid] = [prompt, params, []]
        self.pool.num_used += 1

    def abort_request(self, rid):
        self.thread_ids.add(threading.get_ident())
        if self.reqs.pop(rid, None) is not None:
            self.aborted.append(rid)
            self.pool.num_used -= 1

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.gate.wait(5)
        self.stats.steps += 1
        if self.fail_at_step == self.stats.steps:
            raise RuntimeError("boom")
        self.batch_sizes.append(len(self.reqs))
        outs = []
        for rid, (prompt, params, toks) in list(self.reqs.items()):
            toks.append(len(toks))
            failed = rid == self.fail_request and len(toks) == 2
            done = failed or len(toks) >= params.max_tokens
            if done:
                del self.reqs[rid]
                self.pool.num_used -= 1
            reason = "error" if failed else "length" if done else None
            outs.append(RequestOutput(rid, None, prompt, token_ids=list(toks), finished=done,
                                      finish_reason=reason, new_token_ids=toks[-1:],
                                      error="ValueError: bad state" if failed else None))
        return outs


def _run(coro_fn, engine: FakeEngine, max_waiting: int = 4, on_fatal=None):
    ae = AsyncEngine(engine, max_waiting, on_fatal=on_fatal)
    ae.start()
    try:
        return asyncio.run(coro_fn(ae)), ae
    finally:
        ae.stop()


async def _collect(stream) -> list[RequestOutput]:
    return [o async for o in stream]


def test_concurrent_requests_share_steps_and_complete():
    eng = FakeEngine()

    async def go(ae):
        streams = [ae.submit(f"r{i}", [1, 2], SamplingParams(max_tokens=5)) for i in range(6)]
        return await asyncio.gather(*(_collect(s) for s in streams))

    results, ae = _run(go, eng)
    for outs in results:
        assert [len(o.token_ids) for o in outs] == [1, 2, 3, 4, 5] and outs[-1].finished
    assert max(eng.batch_sizes) == 6  # all six in one step: one loop batches everyone
    assert ae.num_in_flight == 0 and eng.aborted == []
    assert len(eng.thread_ids) == 1 and threading.get_ident() not in eng.thread_ids


def test_close_and_cancel_abort_the_request():
    eng = FakeEngine()

    async def go(ae):
        s1 = ae.submit("closed", [1], SamplingParams(max_tokens=10 ** 9))
        await s1.__anext__()
        s1.close()
        s2 = ae.submit("cancelled", [1], SamplingParams(max_tokens=10 ** 9))
        task = asyncio.ensure_future(_collect(s2))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the engine thread applies the aborts between steps
            if len(eng.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        return ae.num_in_flight

    in_flight, ae = _run(go, eng)
    assert in_flight == 0
    assert sorted(eng.aborted) == ["cancelled", "closed"] and eng.reqs == {}
    assert ae.snapshot.kv_blocks_used == 0


def test_full_server_refuses_at_once():
    eng = FakeEngine(max_num_seqs=2)
    eng.gate.clear()  # steps block: nothing finishes while we fill the server

    async def go(ae):
        streams = [ae.submit(f"r{i}", [1], SamplingParams(max_tokens=2)) for i in range(3)]
        with pytest.raises(QueueFullError, match="max_waiting = 3"):
            ae.submit("one-too-many", [1], SamplingParams(max_tokens=2))
        eng.gate.set()
        await asyncio.gather(*(_collect(s) for s in streams))
        ae.submit("fits-again", [1], SamplingParams(max_tokens=1)).close()

    _run(go, eng, max_waiting=1)


def test_a_failed_request_fails_alone():
    eng = FakeEngine(fail_request="bad")

    async def go(ae):
        bad = ae.submit("bad", [1], SamplingParams(max_tokens=5))
        good = ae.submit("good", [1], SamplingParams(max_tokens=5))
        with pytest.raises(RequestFailedError, match="bad state"):
            await _collect(bad)
        outs = await _collect(good)
        late = await _collect(ae.submit("late", [1], SamplingParams(max_tokens=2)))
        return outs, late, ae.alive, ae.num_in_flight

    (outs, late, alive, in_flight), _ = _run(go, eng)
    assert len(outs[-1].token_ids) == 5 and len(late[-1].token_ids) == 2
    assert alive and in_flight == 0 and eng.pool.num_used == 0


def test_engine_failure_fails_requests_and_later_submits():
    eng = FakeEngine(fail_at_step=2)
    fatal = []

    async def go(ae):
        s = ae.submit("r", [1], SamplingParams(max_tokens=10))
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(s)
        assert not ae.alive
        with pytest.raises(EngineDeadError):
            ae.submit("late", [1], SamplingParams(max_tokens=1))
        return ae.num_in_flight

    in_flight, ae = _run(go, eng, on_fatal=fatal.append)
    assert in_flight == 0
    assert [str(e) for e in fatal] == ["boom"] and str(ae.error) == "boom"


def test_stop_aborts_what_is_still_held():
    eng = FakeEngine()
    ae = AsyncEngine(eng, 4)
    ae.start()

    async def go():
        s = ae.submit("r", [1], SamplingParams(max_tokens=10 ** 6))
        await s.__anext__()
        await asyncio.to_thread(ae.stop)
        with pytest.raises(EngineDeadError, match="shutting down"):
            await _collect(s)

    asyncio.run(go())
    assert eng.aborted == ["r"] and not ae.alive
