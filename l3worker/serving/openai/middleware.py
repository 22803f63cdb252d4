"""ASGI middleware, outermost first: one log line per request (and a 500 without a traceback for
anything unhandled), the API key, the body size limit."""
from __future__ import annotations

import hmac
import logging
import time

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from l3worker.serving.openai.errors import APIError, internal, too_large, unauthorized

log = logging.getLogger("l3worker.serving")
request_log = logging.getLogger("l3worker.serving.requests")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # 16 MiB: a 2M-token prompt as an id list still fits
OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")  # probes and scrapers need no key


class RequestLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 499  # nothing sent: the client left first
        started = False

        async def send_status(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await internal().response()(scope, receive, send_status)
        finally:
            if scope.get("l3worker.disconnected"):
                status = 499  # nginx's code for a client that closed the connection first
            detail = scope.get("l3worker.log")
            client = scope.get("client")
            request_log.info("%s \"%s %s\" %d %.3fs%s", f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                     scope["path"], status, time.perf_counter() - t0, f" {detail()}" if detail else "")


def route_path(scope: Scope) -> str:
    """The path the routes see: without --root-path, which uvicorn puts in front of it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKey:
    """vLLM's --api-key: one key or several, any of which is accepted."""

    def __init__(self, app: ASGIApp, api_key: str | list[str] | tuple[str, ...] | None):
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
        self.expected = [f"Bearer {k}".encode() for k in keys if k]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.expected or scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("authorization", "").encode()
        # Every key is compared, so that the time taken does not tell which one was close.
        if not sum(hmac.compare_digest(given, key) for key in self.expected):
            return await unauthorized().response()(scope, receive, send)
        await self.app(scope, receive, send)


class _TooLarge(HTTPException):
    """An HTTPException so that the framework's body reader passes it on as it is."""

    def __init__(self, max_bytes: int):
        error = too_large(max_bytes)
        super().__init__(413, error.message, {"connection": "close"})


class BodyLimit:
    """413 for a body over the limit: at once from Content-Length, or while a chunked body arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error: APIError = too_large(self.max_bytes)
        response = error.response()
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)
