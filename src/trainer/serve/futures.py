"""The futures table: every accepted request's future, its resend record, and each key's work in flight.

Each accepted request gets a random id (`req-<96 bits>`); `retrieve_future` long-polls it for up to `poll_s`
seconds (under the SDK's 45 s read timeout) and answers `{"type": "try_again"}` while it runs, the result
(JSON, or protobuf for forward/backward and sampling), or `{"error", "category"}` when it failed: category
`user` for a request the engine refused (ValueError), `server` otherwise.

De-duplication of resends is keyed by `(key, kind, model or session, seq_id)` and checks a digest of the
body: an identical resend gets the first reply; a different request with a taken `seq_id` is refused (409,
marked not to be retried), so one request can never receive another's future. Together with the engine's
per-model ordered worker this makes each model's training requests an ordered, idempotent command log.

The per-key count of accepted requests whose future is not done bounds each key (`--max-inflight-per-key`,
429, which the SDK retries) and the server (`--max-inflight`), and is what `/stats` reports per key.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from trainer.serve.limits import Limits
from trainer.serve.replies import Refused
from trainer.serve.samplers import KEYLESS_NOTE, session_of

log = logging.getLogger("trainer.serve")
# results kept for retrieval; beyond this the oldest finished quarter expires (HTTP 410 when asked again)
MAX_FUTURES = 50_000


@dataclass
class Pending:
    future: Future
    encode: Callable[[Any], tuple[bytes, str]]
    session: str  # released with its session (finished or expired)


def done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def failed(exc: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f


class FutureTable:
    """Futures by id, the ids of released ones (410), resend records and per-key in-flight counts. The lock
    is the server's: `once` holds it while `make()` registers the future."""

    def __init__(self, limits: Limits, lock: threading.RLock, keyless: bool, poll_s: float):
        self.limits = limits
        self.lock = lock
        self.keyless = keyless
        self.poll_s = poll_s
        self.futures: dict[str, Pending] = {}
        self.owner: dict[str, str] = {}  # future id -> owner (the key's digest)
        self.expired: dict[str, None] = {}  # ids of released futures (410), oldest first
        self.inflight: dict[str, int] = {}  # owner -> accepted requests whose future is not done
        self.taken: dict[tuple, tuple[str, dict]] = {}  # (owner, kind, id, seq) -> (body digest, reply given)

    def register(self, owner: str, future: Future, encode: Callable[[Any], tuple[bytes, str]],
                 **extra: Any) -> dict:
        """Record an accepted request's future; the reply body that names its id (and `extra`'s fields)."""
        rid = f"req-{secrets.token_hex(12)}"
        session = session_of(str(extra.get("model_id") or extra.get("session") or ""))
        extra.pop("session", None)
        self.futures[rid] = Pending(future, encode, session)
        self.owner[rid] = owner
        with self.lock:  # released by the done callback, from whichever thread finishes the future
            self.inflight[owner] = self.inflight.get(owner, 0) + 1
        future.add_done_callback(lambda _: self._release_inflight(owner))
        if len(self.futures) > MAX_FUTURES:  # the oldest finished results expire, as promises do there
            for old in [k for k, p in itertools.islice(self.futures.items(), len(self.futures) // 4)
                        if p.future.done()]:
                self.forget(old)
            if len(self.taken) > 2 * MAX_FUTURES:
                for k in list(itertools.islice(self.taken, len(self.taken) // 2)):
                    del self.taken[k]
        return {"request_id": rid, **{k: v for k, v in extra.items() if v is not None}}

    def _release_inflight(self, owner: str) -> None:
        with self.lock:
            self.inflight[owner] -= 1
            if not self.inflight[owner]:
                del self.inflight[owner]

    def in_flight(self, owner: str | None = None) -> int:
        """Accepted requests not done: one key's, or (None) all keys' together."""
        with self.lock:  # the counts change on engine threads
            return self.inflight.get(owner, 0) if owner is not None else sum(self.inflight.values())

    def forget(self, rid: str) -> None:
        """Drop a future's result; asking for it again is answered 410 (expired), as on the service."""
        self.futures.pop(rid, None)
        self.owner.pop(rid, None)
        self.expired[rid] = None
        if len(self.expired) > 4 * MAX_FUTURES:
            for k in list(itertools.islice(self.expired, len(self.expired) // 2)):
                del self.expired[k]

    def end_session(self, sid: str) -> None:
        """Forget an ended session's futures and resend records (under the server's lock)."""
        prefix = sid + ":"
        for rid in [r for r, p in self.futures.items() if p.session == sid]:
            self.forget(rid)
        for k in [k for k in self.taken if str(k[2]).startswith(prefix) or k[2] == sid]:
            del self.taken[k]

    def once(self, owner: str, key: tuple, digest: str, make: Callable[[], dict]) -> web.Response:
        """The future reply of a request; a resend of the same request gets the first reply again, and a
        different request under a key already taken is refused. A new request past the key's in-flight
        bound is answered 429, which the SDK retries with backoff (`_base_client.py::_should_retry`)."""
        key = (owner, *key)
        with self.lock:
            seen = self.taken.get(key)
            if seen is None:
                busy = self.inflight.get(owner, 0)
                if busy >= self.limits.inflight_per_key:
                    raise Refused(429, f"this key has {busy} requests in flight, this server's limit "
                                       f"({Limits.flag('inflight_per_key')}); retry when some have finished")
                busy = sum(self.inflight.values())
                if busy >= self.limits.inflight:
                    note = f"; {KEYLESS_NOTE}" if self.keyless else ""
                    raise Refused(429, f"this server has {busy} requests in flight, its limit "
                                       f"({Limits.flag('inflight')}); retry when some have finished{note}")
                reply = make()
                self.taken[key] = (digest, reply)
                return web.json_response(reply)
        if seen[0] != digest:
            raise Refused(409, f"{key[1]} request {key[2:]} was already taken with a different body; a "
                               "resend must be identical, and a new request needs a new seq_id")
        return web.json_response(seen[1])

    def pending(self, rid: str, owner: str) -> Pending:
        """This key's pending request `rid`; the unknown-id 404 for another key's or one never made."""
        p = self.futures.get(rid or "")
        if p is None or self.owner.get(rid or "") != owner:
            raise Refused(404, f"unknown request_id {str(rid)[:100]}")
        return p

    def expired_reply(self, rid: str) -> web.Response | None:
        """410 for a released future (plain, not marked no-retry: the SDK resubmits on 410 where it can)."""
        if rid in self.expired:
            return web.json_response({"detail": f"promise {rid} expired"}, status=410)
        return None

    async def result(self, rid: str, pending: Pending, fault: str | None) -> web.Response:
        """`retrieve_future`'s reply: try_again after `poll_s`, the encoded result, or the failure."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), timeout=self.poll_s)
        except TimeoutError:
            return web.json_response({"type": "try_again"})
        except Exception:  # noqa: BLE001, S110 - reported below from the future itself
            pass
        if fault in ("failed_server", "failed_user"):
            return web.json_response({"error": f"injected fault {fault}", "category": fault.split("_")[1]})
        exc = pending.future.exception()
        if exc is not None:
            category = "user" if isinstance(exc, ValueError) else "server"
            return web.json_response({"error": f"{type(exc).__name__}: {exc}", "category": category})
        try:
            body, ctype = pending.encode(pending.future.result())
        except Exception as e:
            log.exception("encoding the result of %s failed", rid)
            return web.json_response({"error": f"server could not encode the result: {e}",
                                      "category": "server"})
        return web.Response(body=body, content_type=ctype.split(";")[0])
