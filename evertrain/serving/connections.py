"""Connections the endpoint will hold: a bound on how many, and a deadline for a request's headers.

uvicorn keeps a connection that has sent nothing, or only part of a request's headers, for as long as the
client likes (its keep-alive timer starts only after a response), so a thousand silent connections hold a
thousand descriptors and every idle one counts against any limit. :func:`guarded_protocol` wraps uvicorn's HTTP
protocol class so that:

- a connection whose request headers have not all arrived ``header_seconds`` after it opened, or after its
  previous response ended, is closed (``header_timeouts`` counts them);
- a connection beyond ``max_connections`` open at once is answered ``503`` with an OpenAI-style JSON error
  and closed before anything is read from it (``connections_refused``).

The body has its own deadline, in the request handler (``serving.body_timeout_seconds``: a 408).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("evertrain.serving")


@dataclass
class ConnectionStats:
    """What the guard refused, for ``/health``."""

    header_timeouts: int = 0
    connections_refused: int = 0


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {"message": f"the endpoint holds its limit of {max_connections} open connections; "
                                            "retry shortly", "type": "service_unavailable", "param": None,
                                 "code": "too_many_connections"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_protocol(header_seconds: float, max_connections: int, stats: ConnectionStats) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``httptools`` when installed, else ``h11``) with the header deadline and the
    connection bound; pass it as ``uvicorn.Config(http=...)``."""
    refusal = _refusal(max_connections)

    class Guarded(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None
        _waiting_since: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                stats.connections_refused += 1
                transport.write(refusal)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            """Start the header deadline: the next request's headers must be in by then (not while a request,
            a pipelined one included, is being answered)."""
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                return
            self._waiting_since = self.cycle
            self._deadline = self.loop.call_later(header_seconds, self._expire)

        def _expire(self) -> None:
            self._deadline = None
            if self.cycle is self._waiting_since and not self.transport.is_closing():  # no new request began
                stats.header_timeouts += 1
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the keep-alive timer covers silence; this covers a request trickled in

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

    return Guarded
