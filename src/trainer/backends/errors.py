"""Error classes shared by the backends and the trainer's retry policy."""

from __future__ import annotations

import tinker


class TransientBackendError(RuntimeError):
    """A call failed before changing any server state; retrying it is safe."""


# Errors after which the same request may simply be sent again. Tinker's own SDK already
# retries connection errors internally; what reaches us here has exhausted those retries.
RETRYABLE = (TransientBackendError, tinker.APIConnectionError, tinker.APITimeoutError,
             tinker.InternalServerError, tinker.RateLimitError, TimeoutError, ConnectionError)


# The subset after which the request certainly changed nothing on the server. A timeout, a 5xx or a
# dropped connection may arrive after the server applied the call; for calls that change the weights or
# accumulate gradients (forward_backward, optim_step) sending them again could apply them twice, so the
# trainer retries those in place only for these errors and otherwise redoes the step from a checkpoint.
NOT_APPLIED = (TransientBackendError, tinker.RateLimitError)


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, RETRYABLE)


def is_not_applied(exc: BaseException) -> bool:
    return isinstance(exc, NOT_APPLIED)
