"""Scheduling policies: the swappable ordering and preemption-victim choice.

The scheduler core asks a policy three questions each step: in which order to consider
waiting requests for admission, in which order running requests get tokens when the budget
binds, and whom to preempt when KV blocks run out. With the default (`FCFSPolicy`) the
engine is a plain first-come-first-served engine.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from entropic.engine.request import Request


class SchedulingPolicy(Protocol):
    """Hook for the scheduler: orders queues and picks preemption victims."""

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        """Waiting requests, the one to admit first at the front."""
        ...

    def order_running(self, running: Sequence[Request], step: int) -> list[Request]:
        """Running requests, the one to serve first at the front."""
        ...

    def choose_victim(self, candidates: Sequence[Request], step: int) -> Request:
        """The running request to preempt when blocks run out."""
        ...


class FCFSPolicy:
    """First come, first served: oldest arrival first; the newest arrival is preempted."""

    @staticmethod
    def _key(r: Request) -> tuple[float, int]:
        return (r.metrics.arrival_time, r.seq_no)

    def order_waiting(self, waiting: Sequence[Request], step: int) -> list[Request]:
        return sorted(waiting, key=self._key)

    def order_running(self, running: Sequence[Request], step: int) -> list[Request]:
        return sorted(running, key=self._key)

    def choose_victim(self, candidates: Sequence[Request], step: int) -> Request:
        return max(candidates, key=self._key)
