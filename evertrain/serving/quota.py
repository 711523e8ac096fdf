"""Per-client quotas of the endpoint: requests and tokens a minute, each client on its own.

A client is its API key (``serving.auth = "keys"``), else the address it connects from. Each request is
counted when it is admitted, with the tokens it may cost: the completion tokens it asks for
(``max_tokens`` × ``n``) plus its prompt's length in characters / 4 (a rough token count, known before the
model sees it). Over ``serving.requests_per_minute`` or ``serving.tokens_per_minute`` in the last 60 seconds,
a request gets a 429 (``rate_limit_exceeded``, OpenAI's code; the ``openai`` client raises
``RateLimitError``) with a ``Retry-After`` header saying when the oldest counted request leaves the window.
A refused request costs nothing and is not counted. The windows live in the endpoint's memory: each endpoint
process counts its own clients (two endpoints behind one balancer each allow the full quota).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

WINDOW_S = 60.0


class Quotas:
    """Sliding one-minute windows of (time, tokens) per client (thread-safe)."""

    def __init__(self, requests_per_minute: int, tokens_per_minute: int) -> None:
        self.requests, self.tokens = requests_per_minute, tokens_per_minute
        self._seen: dict[str, deque[tuple[float, int]]] = {}
        self._used: dict[str, int] = {}  # each window's token total, kept as requests enter and leave it
        self._lock = threading.Lock()
        self.refused = 0

    def admit(self, client: str, tokens: int, at: float | None = None) -> tuple[str, float] | None:
        """Count a request of ``tokens`` for ``client``; or, over a quota, count nothing and return (which quota,
        seconds until a retry can pass)."""
        if not self.requests and not self.tokens:
            return None
        now = time.monotonic() if at is None else at
        with self._lock:
            window = self._seen.setdefault(client, deque())
            used = self._used.get(client, 0)
            while window and window[0][0] <= now - WINDOW_S:
                used -= window.popleft()[1]
            self._used[client] = used
            if self.requests and len(window) >= self.requests:
                self.refused += 1
                return "requests", window[0][0] + WINDOW_S - now
            if self.tokens and used + tokens > self.tokens:
                self.refused += 1
                if tokens > self.tokens:  # never passes: say so rather than a retry time
                    return "tokens", math.inf
                freed, wait = used + tokens - self.tokens, 0.0
                for stamp, spent in window:  # the oldest requests leave first
                    freed -= spent
                    wait = stamp + WINDOW_S - now
                    if freed <= 0:
                        break
                return "tokens", wait
            window.append((now, tokens))
            self._used[client] = used + tokens
            if len(self._seen) > 100_000:  # bounded: forget clients idle for a whole window
                for name in [n for n, w in self._seen.items() if not w or w[-1][0] <= now - WINDOW_S]:
                    del self._seen[name]
                    self._used.pop(name, None)
            return None

    def used(self, client: str) -> tuple[int, int]:
        """(requests, tokens) ``client`` has counted in its window now."""
        with self._lock:
            window = self._seen.get(client, ())
            now = time.monotonic()
            live = [tokens for stamp, tokens in window if stamp > now - WINDOW_S]
            return len(live), sum(live)


class InFlight:
    """Completion tokens each client has waiting or being sampled (thread-safe): a client past
    ``serving.max_queued_tokens`` waits for its own requests to end, so one client cannot fill the queue."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()
        self.refused = 0

    def enter(self, client: str, tokens: int) -> bool:
        """Hold ``tokens`` for ``client``; False (nothing held) when that would pass the limit. A request alone
        larger than the limit passes when the client has nothing else in flight (max_tokens bounds it)."""
        if not self.max_tokens:
            return True
        with self._lock:
            held = self._held.get(client, 0)
            if held and held + tokens > self.max_tokens:
                self.refused += 1
                return False
            self._held[client] = held + tokens
            return True

    def leave(self, client: str, tokens: int) -> None:
        if not self.max_tokens:
            return
        with self._lock:
            left = self._held.get(client, 0) - tokens
            if left > 0:
                self._held[client] = left
            else:
                self._held.pop(client, None)

    def held(self, client: str | None = None) -> int:
        """Tokens ``client`` holds (None: every client together)."""
        with self._lock:
            return sum(self._held.values()) if client is None else self._held.get(client, 0)
