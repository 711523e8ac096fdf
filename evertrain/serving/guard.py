"""The endpoint's request hygiene, before any handler runs (issue 45, "Safe to serve"): an ASGI middleware.

- **Host**: the ``Host`` header must name this endpoint (``serving.allowed_hosts``, by default localhost,
  127.0.0.1 and ::1, plus the address the request reached): a page on another domain that DNS-rebinds its
  name to 127.0.0.1 gets a 421, never the model or the traces.
- **Origin**: a browser sends ``Origin`` on every cross-origin POST; one not in ``serving.cors_origins``
  (empty by default: no CORS) gets a 403. Allowed origins get the CORS headers and preflight answers.
- **Content-Type**: a POST to a JSON endpoint with a body type other than JSON (``text/plain``, a form) is
  refused with a 415, so a browser's "simple" request that skips the CORS preflight never reaches a handler.

Every refusal is an OpenAI-style JSON error. It also remembers the trace ids the endpoint answered recently
(:class:`TraceIds`), so ``POST /feedback`` can refuse an id that names no trace (:func:`feedback_refusal`).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from evertrain.config import ServingConfig
    from evertrain.data.store import Store

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_PATHS = frozenset({"/v1/chat/completions", "/feedback"})  # the POST endpoints that take a JSON body
LOOPBACK = ("localhost", "127.0.0.1", "::1")
TRACE_HEADER = b"x-evertrain-trace-id"  # evertrain.serving.app.TRACE_HEADER, as ASGI sends it
CALLER_STATE = "evertrain_api_key"  # evertrain.serving.auth.STATE_KEY: where the key middleware leaves the caller
REWARD_RANGE = (0.0, 1.0)  # a verifier's rewards: 0 failed, 1 passed, partial credit between


def error_body(message: str, *, code: str, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body (the shape of evertrain.serving.app.ApiError's)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port, lower case: ``[::1]:8000`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") > 1:  # a bare IPv6 address (not valid in Host, but not a name either)
        return header
    return header.partition(":")[0].rstrip(".")


MISSING = object()  # TraceIds.owner's answer for a trace that does not exist


class TraceIds:
    """The trace ids this endpoint answered lately (the last ``size``) with the API key each was answered for,
    and, for older ones or another endpoint's, ``lookup`` (the store): whether ``POST /feedback`` names a trace
    that exists, and whose it is."""

    def __init__(self, lookup: Callable[[str], Any] | None = None, size: int = 100_000) -> None:
        self.lookup, self.size = lookup, size
        self._recent: OrderedDict[str, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, trace_id: str, key_id: str | None = None) -> None:
        with self._lock:
            self._recent[trace_id] = key_id
            while len(self._recent) > self.size:
                self._recent.popitem(last=False)

    def owner(self, trace_id: str) -> Any:
        """The key id the trace was answered for (None: no key), or :data:`MISSING` when no such trace was
        answered here lately or is stored (a store lookup blocks: call it off the event loop)."""
        with self._lock:
            if trace_id in self._recent:
                return self._recent[trace_id]
        return self.lookup(trace_id) if self.lookup else MISSING

    def known(self, trace_id: str) -> bool:
        """Answered here lately or stored."""
        return self.owner(trace_id) is not MISSING


def feedback_refusal(reward: Any) -> tuple[int, str, str, str] | None:
    """Why a feedback ``reward`` is refused, as (status, message, code, param), or None: a finite number in
    REWARD_RANGE (NaN and infinities pass ``isinstance(.., float)`` and would poison every mean)."""
    low, high = REWARD_RANGE
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
            or not low <= reward <= high:
        return (400, f"'reward' must be a finite number from {low:g} to {high:g}", "invalid_feedback", "reward")
    return None


def allowed_hosts(serving: ServingConfig) -> list[str]:
    """The Host names the endpoint answers for: ``serving.allowed_hosts`` and the name it is bound to (the
    address a request reached is allowed too, by :class:`Guard`)."""
    bound = [] if serving.host in ("0.0.0.0", "::", "") else [serving.host]
    return [*serving.allowed_hosts, *bound]


def stored_trace(store: Store) -> Callable[[str], Any]:
    """The key id of a stored trace (another endpoint's, or one answered before a restart), or :data:`MISSING`."""
    def lookup(trace_id: str) -> Any:
        found, key_id = store.trace_owner(trace_id)
        return key_id if found else MISSING

    return lookup


class Guard:
    """ASGI middleware: Host allow-list, no CORS unless configured, JSON bodies only (see the module)."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: list[str], cors_origins: list[str],
                 trace_ids: TraceIds | None = None) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_name(h) for h in allowed_hosts}
        self.any_origin = "*" in cors_origins
        self.origins = {o.rstrip("/").lower() for o in cors_origins}
        self.trace_ids = trace_ids

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, body = refusal
            await _respond(send, status, body)
            return
        origin = headers.get("origin")
        extra = self._cors_headers(origin) if origin else []
        if origin and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _respond(send, 204, None, [
                *extra, (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers",
                 headers.get("access-control-request-headers", "content-type").encode("latin-1")),
                (b"access-control-max-age", b"600")])
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                if self.trace_ids is not None:
                    for key, value in message.get("headers", []):
                        if key.lower() == TRACE_HEADER:  # with the caller's key, as the key middleware left it
                            caller = scope.get("state", {}).get(CALLER_STATE)
                            self.trace_ids.add(value.decode("latin-1"), getattr(caller, "key_id", None))
                if extra:
                    message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        await self.app(scope, receive, sending)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, dict[str, Any]] | None:
        host = host_name(headers.get("host", ""))
        server = scope.get("server") or ("", 0)
        if not self.any_host and host not in self.hosts and host != host_name(str(server[0])):
            return 421, error_body(
                f"this endpoint does not answer for host {host or '(none)'!r}: add it to serving.allowed_hosts "
                "if clients reach it by that name", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not (self.any_origin or origin.rstrip("/").lower() in self.origins):
            return 403, error_body(
                f"cross-origin requests from {origin!r} are refused: this endpoint allows no CORS unless "
                "serving.cors_origins names the origin", code="origin_not_allowed", kind="permission_error")
        if scope["method"] == "POST" and scope["path"] in JSON_PATHS:
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind and kind != "application/json" and not kind.endswith("+json"):
                return 415, error_body(f"the request body must be JSON (Content-Type: application/json), not {kind}",
                                       code="unsupported_media_type", param="content-type")
        return None

    def _cors_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                (b"access-control-expose-headers", b"x-evertrain-trace-id, x-evertrain-model-version")]


async def _respond(send: Send, status: int, body: dict[str, Any] | None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    start = [(b"content-length", str(len(payload)).encode()), *(headers or [])]
    if body is not None:
        start.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": payload})
