"""ASGI guards in front of the coordinator's routes: status counts, the auth gate, body limits.

Plain ASGI middleware: a refusal happens before a body is read, so an unauthenticated or
oversized upload costs the server nothing.
Order, outermost first: ``StatusCounter`` -> ``AuthGate`` -> ``BodyLimit`` -> ``BodyDeadline``
-> routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.requests import ClientDisconnect

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("crossfed.http")

#: routes whose bodies are model-sized (delta uploads); every other route carries small JSON
BLOB_ROUTE = re.compile(r"^/v1/(blobs/[^/]*|rounds/[^/]+/deltas/inline)$")
CLIENT_CLOSED = 499
#: the one route served to anybody
PUBLIC_PATHS = frozenset({"/v1/health"})
#: the status page authenticates itself (admin token or its session cookie)
UI_PREFIX = "/v1/ui"


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None. The scheme name is
    case-insensitive (RFC 7235: ``bearer``, ``BEARER``); the token is taken as sent."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _send_json(send: Send, status: int, body: dict[str, Any], headers=()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class StatusStats:
    """Responses by status code since the process started (thread-safe)."""

    def __init__(self) -> None:
        self.started_at = time.time()
        self._lock = threading.Lock()
        self._codes: Counter[int] = Counter()
        #: request and response body bytes through the API (what the sites move through it)
        self._bytes = {"in": 0, "out": 0}

    def record(self, status: int, bytes_in: int = 0, bytes_out: int = 0) -> None:
        with self._lock:
            self._codes[status] += 1
            self._bytes["in"] += bytes_in
            self._bytes["out"] += bytes_out

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            codes, moved = dict(self._codes), dict(self._bytes)
        return {
            "bytes_in": moved["in"],
            "bytes_out": moved["out"],
            "since": self.started_at,
            "requests": sum(codes.values()),
            "http_2xx": sum(n for c, n in codes.items() if 200 <= c < 300),
            "http_4xx": sum(n for c, n in codes.items() if 400 <= c < 500),
            "http_5xx": sum(n for c, n in codes.items() if c >= 500),
            "by_status": {str(c): n for c, n in sorted(codes.items())},
        }


class StatusCounter:
    """Counts every response by status, and the body bytes in and out; logs each 5xx
    (method and path, never the query).

    A client that goes away before its answer (``ClientDisconnect`` while the body is read)
    is counted as 499, nginx's "client closed request": nobody is there to answer, and it is
    not a server error. Nothing else is swallowed.
    """

    def __init__(self, app: ASGIApp, stats: StatusStats) -> None:
        self.app, self.stats = app, stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen: list[int] = []
        moved = [0, 0]

        async def counting_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                moved[0] += len(message.get("body", b""))
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen.append(int(message["status"]))
            elif message["type"] == "http.response.body":
                moved[1] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, recording_send)
        except ClientDisconnect:
            if seen:
                raise
            seen.append(CLIENT_CLOSED)
        except Exception:
            if not seen:
                seen.append(500)
            raise
        finally:
            status = seen[0] if seen else 500
            self.stats.record(status, moved[0], moved[1])
            if status >= 500:
                log.error("http_5xx status=%d %s %s", status, scope["method"], scope["path"])


class AuthGate:
    """401 for every request without a known bearer token, except the public health check.

    ``identify`` maps a token to a caller (or None); the routes check what that caller may do.
    """

    def __init__(self, app: ASGIApp, identify: Callable[[str], str | None]) -> None:
        self.app, self.identify = app, identify

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in PUBLIC_PATHS or _is_ui(path):
            await self.app(scope, receive, send)
            return
        token = bearer_token(_header(scope, b"authorization"))
        if token is None:
            detail = "missing 'Authorization: Bearer <token>'"
        elif self.identify(token) is None:
            detail = "unknown token"
        else:
            await self.app(scope, receive, send)
            return
        await _send_json(
            send,
            401,
            {"error": "unauthenticated", "detail": detail},
            [(b"www-authenticate", b"Bearer")],
        )


def _is_ui(path: str) -> bool:
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


class BodyLimit:
    """413 for bodies over the limit, by Content-Length before the first byte is read.

    The limit is picked by route: the blob routes (``BLOB_ROUTE``) get ``max_blob_bytes``,
    every JSON route ``max_json_bytes``. A declared length over it is answered here, in the
    API's error shape; Starlette's ``RequestBodyLimitMiddleware`` cuts off a streamed body
    once it passes the limit (its 413 is an ``HTTPException``, rendered by the app).
    """

    def __init__(self, app: ASGIApp, *, max_json_bytes: int, max_blob_bytes: int) -> None:
        self.limits = {False: max_json_bytes, True: max_blob_bytes}
        self.json = RequestBodyLimitMiddleware(app, max_json_bytes)
        self.blob = RequestBodyLimitMiddleware(app, max_blob_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        blob = scope["type"] == "http" and bool(BLOB_ROUTE.match(scope.get("path", "")))
        if scope["type"] == "http":
            declared = _header(scope, b"content-length")
            limit = self.limits[blob]
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                detail = f"a {declared.strip()}-byte body exceeds this route's {limit}-byte limit"
                await _send_json(
                    send,
                    413,
                    {"error": "body_too_large", "detail": detail},
                    [(b"connection", b"close")],
                )
                return
        await (self.blob if blob else self.json)(scope, receive, send)


class RequestTimeout(HTTPException):
    """A request body that did not arrive within the request bound (answered 408)."""

    def __init__(self, bound_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {bound_s:g} s")


class BodyDeadline:
    """408 for a JSON request whose body is not all in ``max_request_s`` after it began.

    A stalled or trickling client cannot hold a connection and a server task open past the
    bound. Only the body's arrival is timed (the answer may wait for the coordinator's lock);
    the blob routes keep their own bound, which answers with the offset reached.
    """

    def __init__(self, app: ASGIApp, *, max_request_s: float) -> None:
        self.app, self.max_request_s = app, max_request_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or BLOB_ROUTE.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.max_request_s
        body_done = False

        async def bounded_receive() -> Message:
            nonlocal body_done
            if body_done:  # e.g. waiting for a disconnect while answering: not the body
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(self.max_request_s) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, bounded_receive, send)
