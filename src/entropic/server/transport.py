"""The HTTP/1.1 protocol the server runs: uvicorn's h11 protocol with a header timeout.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but gives a client any
time it likes to finish sending its request headers, so a few dozen slow clients (one
header byte every few seconds) hold connections open indefinitely. Here a connection whose
request headers are not complete `timeout_header` seconds after it opened, or after its
previous response, is closed.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(timeout_header: float) -> type[H11Protocol]:
    """An H11Protocol class that closes connections slower than `timeout_header` seconds
    to send their request headers."""
    if not timeout_header > 0:
        raise ValueError(f"timeout_header: must be > 0 seconds, got {timeout_header}")

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers get the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_header, self._expire, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self, cycle) -> None:
            self._header_timer = None
            # still no new request since armed, and the previous one (if any) is answered
            if self.cycle is cycle and (cycle is None or cycle.response_complete):
                if not self.transport.is_closing():
                    self.logger.debug("closing a connection that sent no complete request "
                                      "headers in %.0f s", timeout_header)
                    self.transport.close()

    return HeaderTimeoutProtocol
