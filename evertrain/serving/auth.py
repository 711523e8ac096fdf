"""API keys for the endpoint: made, listed and revoked by ``evertrain keys``, checked on every request.

A key is ``et-`` followed by 43 URL-safe characters (32 random bytes from :mod:`secrets`), shown once when it
is made. The store keeps its SHA-256 (``api_keys.key_sha256``; a 256-bit random secret needs no salt or slow
hash: nobody can guess one to match a leaked hash), its first characters (``prefix``, to tell keys apart), its
name and scopes, and who made and revoked it and when (``api_key_events``, the audit: every create and revoke).

Scopes
    ``infer`` (``/v1/...``: chat completions, models), ``feedback`` (``POST /feedback``), ``admin`` (any other
    route, the API docs included), ``approve`` (no route of the endpoint: answering a promotion that waits for
    a person, :mod:`evertrain.approval`). ``/health`` is open: it says whether a model is served, which version, and
    how many requests and traces wait; the champion watcher's last error (which can name files) only to an
    ``admin`` key.

Checking
    :class:`AuthMiddleware` reads ``Authorization: Bearer <key>`` (``serving.auth = "keys"``, the default).
    A key not in its cache is read from the store on that request (a key made a second ago works at once: no
    watcher, no lag); a key found working is trusted for ``serving.auth_cache_seconds`` (5 s) and then read
    again, so a revoked key stops working at most that long (plus one store read) after ``evertrain keys
    revoke``. Unknown, wrong and revoked keys are not cached: each such request reads the store. A missing,
    unknown or revoked key gets a 401, a key without the route's scope a 403, both OpenAI-style JSON errors; a
    store that cannot be read gets a 503 (a key that cannot be checked is refused). Refused requests are not
    traced (they never reach the model); they are counted (``KeyCache.refused``).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from evertrain.config import ConfigError, is_loopback
from evertrain.data.store import Store, now

log = logging.getLogger("evertrain.serving")

SCOPES = ("infer", "feedback", "admin", "approve")  # approve: answer a promotion waiting for approval
SECRET_PREFIX = "et-"
PREFIX_CHARS = 10  # shown by `evertrain keys list`: "et-" and 7 of the 43 random characters
ENV_VAR = "EVERTRAIN_API_KEY"  # the key the project's own clients (the flywheel demo, benchmarks) send
STATE_KEY = "evertrain_api_key"  # where the middleware leaves the caller's ApiKey in the ASGI scope's state

# the scope each route needs; a route not listed needs 'admin' (so a route added later is closed until it is
# listed); OPEN routes need none
ROUTE_SCOPES = {"/v1/chat/completions": "infer", "/v1/completions": "infer", "/v1/models": "infer",
                "/feedback": "feedback"}
OPEN = frozenset({"/health"})
CACHE_ENTRIES = 10_000


class KeySpecError(ValueError):
    """A key that cannot be made as asked (an unknown scope, an empty name)."""


@dataclass(frozen=True)
class ApiKey:
    """A working key as a request sees it."""

    key_id: str
    name: str
    scopes: frozenset[str]


def hash_secret(secret: str) -> str:
    """The hex SHA-256 of a key's secret: what the store keeps."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def parse_scopes(scopes: str | Iterable[str]) -> tuple[str, ...]:
    """Scopes from 'infer,feedback' (or a list), checked and sorted in :data:`SCOPES`' order."""
    names = [s.strip() for s in (scopes.split(",") if isinstance(scopes, str) else scopes) if s.strip()]
    unknown = sorted(set(names) - set(SCOPES))
    if unknown or not names:
        raise KeySpecError(f"scopes must be some of {', '.join(SCOPES)} (comma-separated), not {','.join(names)!r}")
    return tuple(s for s in SCOPES if s in names)


def actor_name(actor: str | None = None) -> str:
    """Who does it: ``actor`` when given, else the OS user."""
    if actor:
        return actor
    try:
        return getpass.getuser()
    except Exception:  # no login name (a container without a passwd entry)
        return f"uid:{os.getuid()}"


def create_key(store: Store, name: str, scopes: str | Iterable[str], actor: str | None = None) -> tuple[str, dict]:
    """Make a key in ``store``: (its secret, shown this once and stored nowhere; its row, without the hash)."""
    if not name or not name.strip():
        raise KeySpecError("a key needs a name (--name)")
    chosen = parse_scopes(scopes)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    who = actor_name(actor)
    row = {"key_id": f"key_{uuid.uuid4().hex[:16]}", "name": name.strip(), "prefix": secret[:PREFIX_CHARS],
           "key_sha256": hash_secret(secret), "scopes": ",".join(chosen), "created_at": now(), "created_by": who}
    store.add_api_key(row, actor=who, host=socket.gethostname())
    return secret, {k: v for k, v in row.items() if k != "key_sha256"}


def revoke_key(store: Store, name_or_id: str, actor: str | None = None) -> list[dict[str, Any]]:
    """Revoke the working key with this id or name; the keys revoked (empty: none matched)."""
    return store.revoke_api_key(name_or_id, actor=actor_name(actor), host=socket.gethostname())


class KeyCache:
    """Keys looked up in the store by their hash, working ones kept for ``ttl`` seconds (thread-safe)."""

    def __init__(self, store: Store, ttl: float, entries: int = CACHE_ENTRIES) -> None:
        self.store, self.ttl, self.entries = store, ttl, entries
        self._found: OrderedDict[str, tuple[ApiKey, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0  # store look-ups (misses and re-checks)
        self.refused = 0  # requests refused (401, 403, 503)

    def cached(self, digest: str) -> ApiKey | None:
        """The key trusted from the cache (None: not cached, or due for a re-check)."""
        with self._lock:
            entry = self._found.get(digest)
            if entry is None or time.monotonic() - entry[1] >= self.ttl:
                return None
            self._found.move_to_end(digest)
            return entry[0]

    def read(self, digest: str) -> ApiKey | None:
        """Read the key from the store (blocking; errors raised): the working key, or None."""
        self.reads += 1
        row = self.store.api_key_by_hash(digest)
        working = row is not None and (row["revoked_at"] is None or row["revoked_at"] != row["revoked_at"])
        with self._lock:
            if not working:
                self._found.pop(digest, None)
                return None
            key = ApiKey(key_id=str(row["key_id"]), name=str(row["name"]),  # type: ignore[index]
                         scopes=frozenset(str(row["scopes"] or "").split(",")) - {""})  # type: ignore[index]
            self._found[digest] = (key, time.monotonic())
            self._found.move_to_end(digest)
            while len(self._found) > self.entries:
                self._found.popitem(last=False)
            return key


def check_secret(store: Store, secret: str | None, scope: str) -> tuple[ApiKey | None, str]:
    """A key given outside a request (an approval's answer): (the working key, "") when ``secret`` is a working
    key of ``store`` with ``scope``, else (the key or None, why it is refused)."""
    if not secret:
        return None, "no API key"
    if not secret.startswith(SECRET_PREFIX) or len(secret) > 200:
        return None, "not an evertrain API key"
    key = KeyCache(store, ttl=0).read(hash_secret(secret))
    if key is None:
        return None, "the API key is not valid (unknown, wrong or revoked)"
    if scope not in key.scopes:
        return key, f"the API key {key.name!r} lacks the scope {scope!r} (it has: {', '.join(sorted(key.scopes))})"
    return key, ""


def required_scope(path: str) -> str | None:
    """The scope a request to ``path`` needs (None: an open route)."""
    if path in OPEN:
        return None
    return ROUTE_SCOPES.get(path.rstrip("/") or "/", "admin")


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None when there is none)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            kind, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() or None if kind.lower() == "bearer" else None
    return None


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class AuthMiddleware:
    """ASGI middleware: every HTTP request but an open route's (and CORS preflights: OPTIONS) needs a working
    key with the route's scope; the caller's :class:`ApiKey` is left in the request's state (``STATE_KEY``)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], keys: KeyCache) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        needed = required_scope(scope["path"])
        token = bearer(scope.get("headers", ()))
        key: ApiKey | None = None
        if token is not None and (needed is not None or scope["method"] != "OPTIONS"):
            try:
                key = await self._lookup(token)
            except Exception as error:  # the store cannot be read: the key cannot be checked, so it is refused
                if needed is not None:
                    log.warning("endpoint: checking an API key failed: %s", error)
                    await self._refuse(send, 503, "the endpoint cannot check API keys now (its store did not "
                                       "answer); try again shortly", "auth_unavailable", "service_unavailable")
                    return
        if needed is not None and scope["method"] != "OPTIONS":
            if key is None:
                message = ("no API key: send 'Authorization: Bearer <key>' (keys are made with `evertrain keys "
                           "create`)" if token is None else "the API key is not valid (unknown, wrong or revoked)")
                await self._refuse(send, 401, message, "invalid_api_key")
                return
            if needed not in key.scopes:
                await self._refuse(send, 403, f"the API key {key.name!r} lacks the scope {needed!r} this route "
                                   f"needs (it has: {', '.join(sorted(key.scopes)) or 'none'})", "insufficient_scope",
                                   "permission_error")
                return
        scope.setdefault("state", {})[STATE_KEY] = key
        await self.app(scope, receive, send)

    async def _lookup(self, token: str) -> ApiKey | None:
        if not token.startswith(SECRET_PREFIX) or len(token) > 200:  # not one of ours: no store read
            return None
        digest = hash_secret(token)
        key = self.keys.cached(digest)
        if key is not None:
            return key
        return await run_in_threadpool(self.keys.read, digest)  # off the event loop: a store read can wait

    async def _refuse(self, send: Send, status: int, message: str, code: str,
                      kind: str = "invalid_request_error") -> None:
        self.keys.refused += 1
        body = error_body(message, code, kind)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="evertrain"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def check_listen(auth: str, host: str) -> None:
    """Refuse (ConfigError) to serve without keys beyond loopback: what config validation says of
    ``serving.host``, for a host given on the command line (``evertrain endpoint --host``)."""
    if auth == "none" and not is_loopback(host):
        raise ConfigError(f"serving.auth = 'none' with --host {host!r}: an endpoint without keys may listen only on "
                          "a loopback address (127.0.0.1, ::1, localhost); use serving.auth = 'keys' and "
                          "`evertrain keys create` to listen beyond this machine")


def caller(state: Any) -> ApiKey | None:
    """The request's key, as the middleware left it (None: no key, or serving.auth = 'none')."""
    return getattr(state, STATE_KEY, None)
