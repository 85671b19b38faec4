"""Error classes shared by the backends and the trainer's retry policy."""

from __future__ import annotations

import tinker


class TransientBackendError(RuntimeError):
    """A call failed before changing any server state; retrying it is safe."""


# Errors after which the same request may simply be sent again. Tinker's own SDK already
# retries connection errors internally; what reaches us here has exhausted those retries.
RETRYABLE = (TransientBackendError, tinker.APIConnectionError, tinker.APITimeoutError,
             tinker.InternalServerError, tinker.RateLimitError, TimeoutError, ConnectionError)


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, RETRYABLE)
