"""Bounded retries with exponential backoff for transient backend errors."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from trainer.backends.errors import is_retryable

log = logging.getLogger(__name__)


@dataclass
class RetryPolicy:
    max_attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    # retries performed so far, by call kind (logged as faults/retries)
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_config(cls, retry_cfg: Any) -> RetryPolicy:
        """The policy of a config's `retry` group (attempts, backoff, backoff cap)."""
        return cls(retry_cfg.max_attempts, retry_cfg.backoff_s, retry_cfg.max_backoff_s)

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
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if not retryable(exc) or attempt == self.max_attempts - 1:
                    raise
                self._note(what, attempt, exc)
                time.sleep(self.delay(attempt))
        raise AssertionError("unreachable")

    async def acall(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        for attempt in range(self.max_attempts):
            try:
                return await fn()
            except Exception as exc:  # noqa: BLE001
                if not is_retryable(exc) or attempt == self.max_attempts - 1:
                    raise
                self._note(what, attempt, exc)
                await asyncio.sleep(self.delay(attempt))
        raise AssertionError("unreachable")
