"""Scheduling policies: the swappable ordering and preemption-victim choice.

The scheduler core asks a policy four questions each step: in which order to serve all
unfinished requests (admission of waiting ones, and which running ones get tokens when the
budget binds), whom to pause (a displacement's victim), whose KV to drop when KV blocks run
out (it is recomputed later), and whether a waiting request may displace a running one
when slots or blocks are full. With the default (`FCFSPolicy`) the
engine is a plain first-come-first-served engine. A policy that prices requests may also
define `bind(cost_model, num_blocks, block_size, max_num_seqs, max_num_batched_tokens)`:
the engine calls it once with its own cost model and KV geometry, and `admitted(req,
waiting)`: the scheduler calls it each time it admits `req`, with the requests still
waiting.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from entropic.engine.request import Request


class SchedulingPolicy(Protocol):
    """Hook for the scheduler: one order over all requests, victims, displacement."""

    def order(self, running: Sequence[Request], waiting: Sequence[Request],
              step: int) -> list[Request]:
        """All unfinished requests, the one to serve first at the front."""
        ...

    def choose_victim(self, candidates: Sequence[Request], step: int) -> Request:
        """The running request a displacement pauses (its KV stays resident)."""
        ...

    def choose_recompute_victim(self, candidates: Sequence[Request], step: int) -> Request:
        """The request whose KV memory pressure drops (computed again on readmission)."""
        ...

    def displace(self, waiting: Request, victim: Request, step: int) -> bool:
        """May `waiting` take the slot/blocks of running `victim` (preempting it)?"""
        ...


class FCFSPolicy:
    """First come, first served: running requests before waiting ones, each by arrival;
    the newest arrival is preempted; nobody is displaced for admission."""

    @staticmethod
    def _key(r: Request) -> tuple[float, int]:
        return (r.metrics.arrival_time, r.seq_no)

    def order(self, running: Sequence[Request], waiting: Sequence[Request],
              step: int) -> list[Request]:
        return sorted(running, key=self._key) + sorted(waiting, key=self._key)

    def choose_victim(self, candidates: Sequence[Request], step: int) -> Request:
        return max(candidates, key=self._key)

    choose_recompute_victim = choose_victim

    def displace(self, waiting: Request, victim: Request, step: int) -> bool:
        return False
