"""Bounded retries with exponential backoff for transient backend errors, and the call deadline.

The deadline (`backend.call_deadline_s`, tinker only) bounds how long a call may wait while no call of
the run gets a successful reply: the SDK retries a dead server's connection errors without end (futures
poll with backoff, submissions for 5 minutes each), so without it a run whose server died waits
forever. A call past the deadline raises `ClientLostError`, which the loop answers by redoing the step
from its checkpoint with a new client. The clock is the later of the call's start and the run's last
successful reply, so a call queued behind many others on a busy but live server (the concurrent
requests of one sampling batch) is not given up while replies keep arriving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from trainer.backends.errors import ClientLostError, is_retryable

if TYPE_CHECKING:
    from trainer.config.schema import RetryConfig

log = logging.getLogger(__name__)


@dataclass
class RetryPolicy:
    max_attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # retries performed so far, by call kind (logged as faults/retries)
    counts: dict[str, int] = field(default_factory=dict)
    # seconds a call may go without any successful reply of the run (None: no deadline)
    deadline_s: float | None = None
    # time.monotonic() of the run's last successful reply
    last_reply: float = field(default_factory=time.monotonic)
    # how often a waiting call looks at the clock (seconds)
    tick_s: float = 0.5

    @classmethod
    def from_config(cls, retry_cfg: RetryConfig, deadline_s: float | None = None) -> RetryPolicy:
        """The policy of a config's `retry` group (attempts, backoff, backoff cap), with the backend's
        call deadline (`backend.call_deadline_s`; None for a backend without one)."""
        return cls(retry_cfg.max_attempts, retry_cfg.backoff_s, retry_cfg.max_backoff_s,
                   deadline_s=None if deadline_s is None else float(deadline_s))

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2 ** attempt))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _note(self, what: str, attempt: int, exc: BaseException) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        log.warning("%s failed (attempt %d/%d): %s: %s; retrying", what, attempt + 1,
                    self.max_attempts, type(exc).__name__, exc)

    def call(self, what: str, fn: Callable[[], Any],
             retryable: Callable[[BaseException], bool] = is_retryable) -> Any:
        """Run `fn()` (which submits a request and waits for its result), retrying the errors `retryable`
        accepts (default: every transient error; non-idempotent calls pass a narrower test)."""
        for attempt in range(self.max_attempts):
            try:
                return self._within_deadline(what, fn)
            except Exception as exc:  # noqa: BLE001 - classified below
                if not retryable(exc) or attempt == self.max_attempts - 1:
                    raise
                self._note(what, attempt, exc)
                time.sleep(self.delay(attempt))
        raise AssertionError("unreachable")

    async def acall(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        for attempt in range(self.max_attempts):
            try:
                return await self._awithin_deadline(what, fn)
            except Exception as exc:  # noqa: BLE001
                if not is_retryable(exc) or attempt == self.max_attempts - 1:
                    raise
                self._note(what, attempt, exc)
                await asyncio.sleep(self.delay(attempt))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ deadline
    def _overdue(self, started: float) -> bool:
        return self.deadline_s is not None and time.monotonic() - max(started, self.last_reply) > self.deadline_s

    def _lost(self, what: str) -> ClientLostError:
        return ClientLostError(f"no successful reply from the backend for {self.deadline_s:g} s while waiting for "
                               f"{what} (backend.call_deadline_s)")

    def _within_deadline(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, given up (`ClientLostError`) once the deadline passes. The call runs on a daemon thread,
        since a blocking SDK wait cannot be interrupted; a call given up is left to end on its own (the
        loop closes the old client's connections, which ends its retries)."""
        if self.deadline_s is None:
            return fn()
        box: dict[str, Any] = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e
            finally:
                done.set()

        started = time.monotonic()
        threading.Thread(target=target, name=f"backend-{what}", daemon=True).start()
        while not done.wait(self.tick_s):
            if self._overdue(started):
                raise self._lost(what)
        if "error" in box:
            raise box["error"]
        self.last_reply = time.monotonic()
        return box["value"]

    async def _awithin_deadline(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        if self.deadline_s is None:
            return await fn()
        started = time.monotonic()
        task = asyncio.ensure_future(fn())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.tick_s)
                if done:
                    break
                if self._overdue(started):
                    raise self._lost(what)
        except BaseException:  # given up, or this coroutine cancelled (a sibling request failed)
            task.cancel()  # an SDK future cancelled this way also cancels its request
            raise
        value = task.result()
        self.last_reply = time.monotonic()
        return value
