"""ASGI middleware: error counting by status, the API key, and the bounded request body.

Order (outermost first): `StatusCounter` sees every response; `ApiKey` refuses a request before
its body is read; `BoundedBody` reads the body before the app does, within `max_body_bytes` and
`body_timeout_s`, and hands it on in one piece.
"""
from __future__ import annotations

import asyncio
import secrets
import time

from speculant.server.errors import ApiError

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
# A refused body is still read (and dropped) up to this, so that clients that send the whole
# body before reading the answer get the 413 instead of a reset connection.
DRAIN_MAX_BYTES = 256 * 1024 * 1024
DRAIN_MAX_S = 5.0


class StatusCounter:
    """Counts every response with status >= 400 in `metrics.errors` (by status)."""

    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.errors.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class ApiKey:
    """Refuses (401) any request to a path outside `OPEN_PATHS` without the bearer key. The
    scheme is case-insensitive (RFC 7235): 'Bearer', 'bearer' and 'BEARER' all work."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(),
                                                                         self._expected):
                error = ApiError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                 "<key>'", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BoundedBody:
    """Reads a request's body before the app does: 413 past `max_bytes` (at once when the
    Content-Length says so), 408 when it does not arrive within `timeout_s`."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, receive, send, self._too_large(declared))
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:
            error = ApiError(408, f"request body not received within {self.timeout_s:g} s",
                             code="body_timeout", headers={"Connection": "close"})
            return await error.response()(scope, receive, send)
        if body is None:  # the client left while sending
            return
        if isinstance(body, int):
            return await self._refuse(scope, receive, send, self._too_large(body))
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> bytes | int | None:
        """The whole body; its size so far (an int) once past the limit; None on disconnect."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return size
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> ApiError:
        return ApiError(413, f"request body too large: {size} bytes or more; this server "
                        f"accepts at most {self.max_bytes} (--max-body-bytes)",
                        code="body_too_large", headers={"Connection": "close"})

    async def _refuse(self, scope, receive, send, error: ApiError) -> None:
        await _drain(receive)
        await error.response()(scope, receive, send)


def _content_length(scope) -> int | None:
    value = dict(scope["headers"]).get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _drain(receive) -> None:
    """Read and drop what the client is still sending, within DRAIN_MAX_BYTES / DRAIN_MAX_S."""
    deadline = time.monotonic() + DRAIN_MAX_S
    drained = 0
    while drained < DRAIN_MAX_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))


def _replay(body: bytes, receive):
    """A `receive` that yields the already-read body once, then the client's own messages
    (a disconnect, for streaming handlers that watch for one)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
