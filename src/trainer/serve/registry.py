"""The sessions and models registry: who owns which id, what each session holds, and its end.

Every id handed out (session, model, sampler, loss) is random per boot and bound to the key that created
it (its digest, the "owner"): another key is answered 404, the same answer as for an id that never
existed, so ids cannot be probed. Sessions, models, samplers and losses are only created under a session
this boot issued to the same key. A model slot is reserved when its create is accepted (a create still
running holds its slot, so concurrent creates cannot pass the limit together) and freed when the session
ends or the create fails. A session not heard from (heartbeat or use) for `--session-timeout-s` ends: its
models, samplers, losses, futures and resend records are released and its engine work cancelled
(`sessions.stop_work`). Each model's state (weights, optimizer, poisoned flag) is its own: nothing of one
model is reachable through another's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from trainer.serve.futures import FutureTable
from trainer.serve.limits import LimitExceeded, Limits
from trainer.serve.replies import Refused
from trainer.serve.samplers import KEYLESS_NOTE, SamplerSlots, session_of
from trainer.serve.sessions import stop_work

log = logging.getLogger("trainer.serve")


class Registry:
    def __init__(self, engine: Any, limits: Limits, lock: threading.RLock, keyless: bool,
                 session_timeout_s: float, pool: Executor, futures: FutureTable, rest: Any):
        self.engine = engine
        self.limits = limits
        self.lock = lock
        self.keyless = keyless
        self.session_timeout_s = session_timeout_s
        self.pool = pool
        self.futures = futures
        self.rest = rest  # told of each session's end (its REST listing is pruned)
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.owner: dict[str, str] = {}  # model / sampler / loss id -> owner (the key's digest)
        self.models: dict[str, Any] = {}
        self.poisoned: set[str] = set()
        self.samplers: dict[str, Any] = {}
        self.losses: dict[str, Any] = {}
        self.last_seen: dict[str, float] = {}  # session id -> monotonic time of its last heartbeat or use
        self.expired_sessions = 0
        self.slots: dict[str, set[str]] = {}  # owner -> model ids reserved (created or being created)
        self.sampler_slots = SamplerSlots(limits, lock, keyless=keyless)
        self._expiry: asyncio.Task | None = None

    def keyless_note(self) -> str:
        """Said with a server-wide refusal when any `tml-` key is accepted (`samplers.KEYLESS_NOTE`)."""
        return f"; {KEYLESS_NOTE}" if self.keyless else ""

    # ------------------------------------------------------------------ lookups
    def touch(self, session_id: str) -> None:
        """A session in use is alive (besides its heartbeats, which a raw-HTTP client may not send)."""
        if session_id in self.last_seen:
            self.last_seen[session_id] = time.monotonic()

    def owned(self, table: dict[str, Any], ident: str | None, owner: str, what: str) -> Any:
        """`table[ident]` when `owner` created it; otherwise the same 404 as an unknown id."""
        obj = table.get(ident or "")
        if obj is None or self.owner.get(ident or "") != owner:
            raise Refused(404, f"unknown {what} {str(ident)[:100]}")
        self.touch(session_of(ident))
        return obj

    def session(self, session_id: str | None, owner: str) -> str:
        """A session this boot issued to `owner` (ids from another boot or key are refused)."""
        if not session_id or self.sessions.get(session_id) != owner:
            raise Refused(404, f"unknown session_id {str(session_id)[:100]}: create a session on this "
                               "server first (ids from before a restart, or of a session that expired or was "
                               "finished, are not valid)")
        self.touch(session_id)
        return session_id

    def model(self, model_id: str, owner: str) -> Any:
        return self.owned(self.models, model_id, owner, "model_id")

    def sampler(self, sid: str | None, owner: str, what: str) -> Any:
        """A sampler of this key (404 for another key's, an unknown or a retired one), marked as used."""
        try:
            sc = self.owned(self.samplers, sid, owner, what)
        except Refused:
            retired = self.sampler_slots.was_retired(str(sid))
            if retired is not None and self.sessions.get(session_of(str(sid))) == owner:
                raise Refused(404, retired) from None
            raise
        self.sampler_slots.used(str(sid))
        return sc

    # ------------------------------------------------------------------ creation
    def open_session(self, owner: str) -> str:
        """A new session id for `owner`, within the per-key and server-wide session caps."""
        sid = f"s-{secrets.token_hex(12)}"
        with self.lock:
            live = sum(1 for o in self.sessions.values() if o == owner)
            if live >= self.limits.sessions_per_key:
                raise LimitExceeded(f"this key already has {live} live sessions, this server's limit "
                                    f"({Limits.flag('sessions_per_key')}); close a ServiceClient, or wait "
                                    f"{self.session_timeout_s:g} s for those whose heartbeats stopped to "
                                    "expire")
            if len(self.sessions) >= self.limits.sessions:
                raise LimitExceeded(f"this server already has {len(self.sessions)} live sessions, its limit "
                                    f"({Limits.flag('sessions')}); a session whose heartbeats stop ends "
                                    f"after {self.session_timeout_s:g} s{self.keyless_note()}")
            self.sessions[sid] = owner
            self.last_seen[sid] = time.monotonic()
        return sid

    def reserve_model(self, owner: str, model_id: str) -> None:
        """Reserve one of the key's model slots at submission."""
        with self.lock:
            mine = self.slots.setdefault(owner, set())
            if model_id not in mine and len(mine) >= self.limits.models_per_key:
                raise LimitExceeded(f"this key already has {len(mine)} live models, this server's limit "
                                    f"({Limits.flag('models_per_key')}); finish a session to free its models "
                                    "(a session whose heartbeats stop ends after "
                                    f"{self.session_timeout_s:g} s)")
            total = sum(len(v) for v in self.slots.values())
            if model_id not in mine and total >= self.limits.models:
                if not mine:
                    del self.slots[owner]
                raise LimitExceeded(f"this server already has {total} live models, its limit "
                                    f"({Limits.flag('models')}); a session's models are freed when it ends"
                                    f"{self.keyless_note()}")
            mine.add(model_id)

    def free_model(self, owner: str, model_id: str) -> None:
        with self.lock:
            mine = self.slots.get(owner, set())
            mine.discard(model_id)
            if not mine:
                self.slots.pop(owner, None)

    def adopt(self, owner: str, model_id: str, tc: Any) -> None:
        """Publish a model made on a loader thread, unless its session ended meanwhile (then it is closed
        and its slot freed: a finish or an expiry during a create leaks nothing)."""
        with self.lock:
            alive = self.sessions.get(session_of(model_id)) == owner
            if alive:
                self.models[model_id] = tc
        if not alive:
            if hasattr(tc, "close"):
                tc.close()
            self.free_model(owner, model_id)
            raise ValueError(f"session {session_of(model_id)} ended while model {model_id} was being "
                             "created")

    def new_sampler(self, sid: str) -> None:
        """Reserve a place for sampler `sid` (`SamplerSlots.reserve`); drop the one it retires (idle, so
        nothing of it is cancelled: an inflight sampler shares its client with the model's others)."""
        with self.lock:
            retire = self.sampler_slots.reserve(sid)
            if retire is not None:
                self.samplers.pop(retire, None)
                self.owner.pop(retire, None)
        if retire is not None:
            self.release_memory()

    def release_memory(self) -> None:
        """What dropped samplers held goes back to the OS, off the event loop (`release_memory`)."""
        if hasattr(self.engine, "release_memory"):
            self.pool.submit(self.engine.release_memory)

    # ------------------------------------------------------------------ end
    def end_session(self, sid: str) -> None:
        """Release everything of a session: models (and the key's slots), samplers, losses, futures and
        de-duplication records. Its work on the engine is cancelled (`sessions.stop_work`)."""
        with self.lock:
            owner = self.sessions.pop(sid, None)
            self.last_seen.pop(sid, None)
            if owner is None:
                return
            prefix = sid + ":"
            for ident in [m for m in self.slots.get(owner, ()) if m.startswith(prefix)]:
                self.free_model(owner, ident)
            self.sampler_slots.end_session(sid)
            closing, samplers = [], 0
            for table in (self.models, self.samplers, self.losses):
                for ident in [i for i in table if i.startswith(prefix)]:
                    obj = table.pop(ident)
                    self.owner.pop(ident, None)
                    samplers += table is self.samplers
                    if table is not self.losses:
                        closing.append(obj)
            self.futures.end_session(sid)
        for obj in closing:
            stop_work(obj)
        if samplers:
            self.release_memory()
        self.rest.prune_sessions(owner, set(self.sessions), self.limits.sessions_per_key)

    async def _expire_sessions(self) -> None:
        """End each session not heard from (heartbeat or use) for `session_timeout_s`."""
        every = min(5.0, self.session_timeout_s / 10)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for sid in [s for s, t in list(self.last_seen.items()) if now - t > self.session_timeout_s]:
                log.info("session %s expired (no heartbeat for %.0f s)", sid, self.session_timeout_s)
                self.expired_sessions += 1
                self.end_session(sid)
            if getattr(self.engine, "memory_to_release", lambda: False)():  # a batch stopped after its end
                self.release_memory()

    async def start_expiry(self, app: web.Application) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self._expire_sessions())

    async def stop_expiry(self, app: web.Application) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
