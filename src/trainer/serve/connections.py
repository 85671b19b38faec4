"""What one client's connections may hold of the server: descriptors, time, and log lines.

Every open connection holds a file descriptor, and the process has a fixed number of them (`ulimit -n`);
once they are gone the event loop cannot accept anything, `/healthz` included, and asyncio logs a
traceback per failed accept (the real-client review, round 5, C12: 1,100 idle connections at 1,024
descriptors, 7,509 tracebacks in under a minute). So:

- open connections are capped (`--max-connections`). A connection past the cap closes the oldest idle
  one (connected, but no request being handled: a keep-alive between requests, or headers not yet
  complete) or, when every one is busy, is closed at once. A flood of idle connections thus cannot keep
  a new client out; a client whose idle keep-alive was closed reconnects, as HTTP clients do.
- requests being handled at once per key are capped (`--max-connections-per-key`, answered 429, which
  the SDK retries): one key cannot hold all the busy slots with bodies it never finishes.
- a request's body must arrive within `--read-timeout-s` plus one second per `MIN_BODY_RATE` bytes
  received (`read_body`), so a body trickled a byte at a time is cut off, not only one that stops; a
  connection that never completes its headers is closed by aiohttp's keep-alive timer
  (`keepalive_timeout`, the same `--read-timeout-s`), and after `MAX_REQUESTS_PER_CONNECTION` requests a
  keep-alive connection is closed after its reply.
- repeated warnings and errors are logged once per kind per `LOG_INTERVAL_S`, with a count of the rest
  (`RateLimitedLog`), so a flood of bad requests cannot fill the disk with tracebacks.

The connection hooks sit on aiohttp 3.14's `web_protocol.RequestHandler` (`connection_made`,
`connection_lost`, `_request_in_progress`, `_request_count`) through `JsonErrorRunner`'s handler class.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web, web_protocol, web_server

from trainer.serve.limits import Limits
from trainer.serve.replies import Refused, error_response

log = logging.getLogger("trainer.serve")
# the slowest body accepted once `--read-timeout-s` has passed: 64 KiB/s (a 64 MiB protobuf may take 17 min)
MIN_BODY_RATE = 64 * 1024
MAX_REQUESTS_PER_CONNECTION = 10_000
LOG_INTERVAL_S = 60.0
GUARD = web.AppKey("connection_guard", object)


async def read_body(request: web.Request, limit: int, flag: str, read_timeout_s: float) -> bytes:
    """The body, read up to `limit` bytes (a chunked body has no Content-Length to check first) within
    `read_timeout_s` plus one second per `MIN_BODY_RATE` bytes received; 408 (and the connection closed
    after the reply) when it is slower, 413 when it is larger."""
    endpoint = request.path.removeprefix("/api/v1/")
    loop = asyncio.get_running_loop()
    start = loop.time()
    chunks, size = [], 0
    while True:
        left = start + read_timeout_s + size / MIN_BODY_RATE - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(request.content.read(1 << 16), left)
        except TimeoutError:
            request["close"] = True  # the rest of the body will not be read: close after the reply
            raise Refused(408, f"request body not received within {read_timeout_s:g} s plus 1 s per "
                               f"{MIN_BODY_RATE // 1024} KiB (--read-timeout-s); {size} bytes arrived"
                          ) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"request body exceeds this server's limit of {limit} bytes for {endpoint} "
                               f"({flag})")
        chunks.append(chunk)
    return b"".join(chunks)


class ConnectionGuard:
    """The open connections of one server and the requests each key has in progress."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.open: dict[web_protocol.RequestHandler, None] = {}  # oldest first
        self.per_key: dict[str, int] = {}
        self.refused = 0  # connections closed at once because every slot was busy
        self.evicted = 0  # idle connections closed to make room

    def opened(self, handler: web_protocol.RequestHandler) -> bool:
        """Admit a new connection (closing the oldest idle one when at the cap); False: close it."""
        if len(self.open) >= self.limits.connections:
            idle = next((h for h in self.open if not h._request_in_progress), None)
            if idle is None:
                self.refused += 1
                log.warning("connection refused: %d open, every one handling a request (%s)",
                            len(self.open), Limits.flag("connections"))
                return False
            self.evicted += 1
            self.open.pop(idle, None)
            idle.force_close()
        self.open[handler] = None
        return True

    def closed(self, handler: web_protocol.RequestHandler) -> None:
        self.open.pop(handler, None)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Inside the server's own middleware (which authenticates and answers `Refused`): the key's
        requests in progress are capped, and a connection that served its share is closed after it."""
        owner = request.get("owner")
        if owner is not None:
            busy = self.per_key.get(owner, 0)
            if busy >= self.limits.connections_per_key:
                request["close"] = True
                raise Refused(429, f"this key has {busy} requests in progress on this server, its limit "
                                   f"({Limits.flag('connections_per_key')}); retry when some have finished")
            self.per_key[owner] = busy + 1
        try:
            resp = await handler(request)
        finally:
            if owner is not None:
                self.per_key[owner] -= 1
                if not self.per_key[owner]:
                    del self.per_key[owner]
        if getattr(request.protocol, "_request_count", 0) >= MAX_REQUESTS_PER_CONNECTION:
            resp.force_close()
        return resp

    def stats(self) -> dict[str, int]:
        return {"open": len(self.open), "refused": self.refused, "evicted_idle": self.evicted}


class _GuardedHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, admitted by the server's `ConnectionGuard`, answering a request it
    cannot parse (headers over 8190 bytes, a bad request line) in the SDK's JSON error shape: aiohttp
    answers those itself, before any middleware, in plain text."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = getattr(self._manager, "guard", None)
        if guard is not None and not guard.opened(self):
            transport.close()  # before aiohttp starts reading it: the descriptor is freed at once
            self._manager = None
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        guard = getattr(self._manager, "guard", None)
        if guard is not None:
            guard.closed(self)
        super().connection_lost(exc)

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs, and refuses once bytes were sent
        reason = getattr(exc, "message", None) or HTTPStatus(status).phrase
        resp = error_response(status, f"{HTTPStatus(status).phrase}: {str(reason).splitlines()[0][:200]}")
        resp.force_close()
        return resp


class _GuardedServer(web_server.Server):
    guard: ConnectionGuard | None = None

    def __call__(self) -> web_protocol.RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """`web.AppRunner` whose connections are admitted by the app's `ConnectionGuard` (`app[GUARD]`, when
    set) and answer unparseable requests in JSON (aiohttp 3.14: `web_protocol.RequestHandler.handle_error`,
    `web_server.Server.__call__`)."""

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        server.guard = self._app.get(GUARD) if self._app is not None else None
        return server


class RateLimitedLog(logging.Filter):
    """Lets one record of each kind (logger, level, message template, exception type) through per
    `interval_s`; the next one after the interval says how many were held back, and `flush` reports
    counts still held. Below WARNING everything passes."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S):
        super().__init__()
        self.interval_s = interval_s
        self.kinds: dict[tuple, list[float | int]] = {}  # kind -> [time of the line let through, held back]

    @staticmethod
    def _kind(record: logging.LogRecord) -> tuple:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        return record.name, record.levelno, str(record.msg)[:200], exc

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "held_back_count", False):
            return True
        now = time.monotonic()
        kind = self._kind(record)
        seen = self.kinds.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        if seen is not None and seen[1]:
            record.msg = f"{record.msg} [and {seen[1]} more like this in the previous {self.interval_s:g} s]"
        if len(self.kinds) > 1000:  # kinds are message templates: few, but never unbounded
            self.kinds.clear()
        self.kinds[kind] = [now, 0]
        return True

    def flush(self, logger: logging.Logger) -> None:
        """One line per kind with records held back over a whole interval (called every interval)."""
        now = time.monotonic()
        for kind, seen in list(self.kinds.items()):
            if seen[1] and now - seen[0] >= self.interval_s:
                logger.warning("%d more log lines like %r (%s) in the last %g s", seen[1], kind[2][:80],
                               kind[3] or logging.getLevelName(kind[1]), self.interval_s,
                               extra={"held_back_count": True})
                self.kinds[kind] = [now, 0]


def install_log_limit(interval_s: float = LOG_INTERVAL_S) -> RateLimitedLog:
    """Put a `RateLimitedLog` on every handler of the root logger (where aiohttp's, asyncio's and the
    server's records end up)."""
    limiter = RateLimitedLog(interval_s)
    for h in logging.getLogger().handlers:
        h.addFilter(limiter)
    return limiter


async def flush_logs_forever(limiter: RateLimitedLog) -> None:
    while True:
        await asyncio.sleep(limiter.interval_s)
        limiter.flush(log)
