"""Error classes shared by the backends and the trainer, and what each backend failure calls for.

Three answers (`classify`), read off tinker 0.38's error paths:
- `RESEND`: nothing was applied; the same request may simply be sent again.
- `RECOVER`: the request may or may not have been applied, or the client or its server-side model is
  gone: a call that changes the weights is redone from the last checkpoint with a new client (an
  idempotent one may be sent again first). This covers what the SDK raises once its own retries are
  spent: `RequestFailedError` (a failed future, either category: `lib/api_future_impl.py`),
  `RetryableException` (HTTP 410 "promise expired", a plain `Exception`, `lib/retryable_exception.py`),
  the `ValueError`s of a result that could not be retrieved or decoded (`api_future_impl.py`, FATAL
  branch and "Proto deserialization failed"), a client poisoned by a failed custom-loss request
  (`RuntimeError`, `training_client.py::_take_turn`), connection errors and timeouts, 409 and 5xx.
- `USER`: the request or the setup is wrong (HTTP 400/401/403/404/422 at submission, a ValueError of
  our own code such as a bad datum or a failing loss function); no retry can fix it.
Anything else (`None`) is a bug in this code and propagates with its traceback.

`RuntimeError` and `OSError` are RECOVER as a class, because the SDK's poisoned-client error is a
RuntimeError and a lost connection can surface as an OSError. A torch error inside the local engine
(a RuntimeError) is therefore not told apart from a lost client: the trainer redoes the step from
the last checkpoint, at most `retry.max_attempts` times at one step, then ends the run with
`TrainingClientLost` chained to the original error and its traceback. A deterministic engine bug
costs those redone attempts before it surfaces.

Lost (`is_lost`): the backend no longer knows a model, sampler or future the run created (HTTP 404 on
it: the server restarted, or the service dropped the model), or no call got a successful reply within
`backend.call_deadline_s` (`ClientLostError`). No resend on the same client can succeed, so the trainer
redoes the step from its last checkpoint with a new client. A 404 on something the user named (a base
model, a checkpoint path) stays USER: only the caller knows which object a request was about, so the
trainer's own wrapper asks `is_lost` for calls on objects it created.
"""

from __future__ import annotations

import tinker
from tinker.lib.retryable_exception import RetryableException


class TransientBackendError(RuntimeError):
    """A call failed before changing any server state; retrying it is safe."""


class ClientLostError(RuntimeError):
    """The backend lost a client the run created, or stopped answering it for longer than the call deadline."""


class BackendRequestError(RuntimeError):
    """The backend refused a request as malformed or unauthorized (the user's fault: no retry helps)."""


RESEND, RECOVER, USER = "resend", "recover", "user"

# HTTP statuses that say the request itself is wrong; the SDK retries 408/409/429/5xx on its own
_USER_STATUSES = (400, 401, 402, 403, 404, 413, 422)
# messages of the ValueErrors the SDK raises when a result cannot be fetched or decoded (server side)
_SDK_RETRIEVAL = ("Error retrieving result", "Proto deserialization failed", "Server returned a JSON payload")

# The errors after which the request certainly changed nothing on the server. A timeout, a 5xx or a
# dropped connection may arrive after the server applied the call; for calls that change the weights or
# accumulate gradients (forward_backward, optim_step) sending them again could apply them twice, so the
# trainer retries those in place only for these errors and otherwise redoes the step from a checkpoint.
NOT_APPLIED = (TransientBackendError, tinker.RateLimitError)


def classify(exc: BaseException) -> str | None:
    """RESEND, RECOVER or USER (see the module docstring); None for an error that is not the backend's."""
    if isinstance(exc, NOT_APPLIED):
        return RESEND
    if isinstance(exc, BackendRequestError):
        return USER
    if isinstance(exc, tinker.RequestFailedError):
        # category user means the server refused the request while running it; a fresh client from a
        # checkpoint redoes it (bounded by retry.max_attempts recoveries), so a persistent refusal still
        # ends the run, with the server's message
        return RECOVER
    if isinstance(exc, tinker.APIStatusError):
        return USER if exc.status_code in _USER_STATUSES else RECOVER
    if isinstance(exc, (RetryableException, tinker.APIConnectionError, TimeoutError, ConnectionError)):
        return RECOVER
    if isinstance(exc, ValueError):
        sdk = isinstance(exc.__cause__, tinker.TinkerError) or str(exc).startswith(_SDK_RETRIEVAL)
        return RECOVER if sdk else USER
    if isinstance(exc, (tinker.TinkerError, RuntimeError, OSError)):
        return RECOVER
    return None


def _status(exc: BaseException | None) -> int | None:
    return exc.status_code if isinstance(exc, tinker.APIStatusError) else None


def is_lost(exc: BaseException) -> bool:
    """A call on an object the run created cannot succeed on this client (see the module docstring): a
    `ClientLostError`, a 404 at submission, or the SDK's ValueError for a future the server no longer knows
    (`api_future_impl.py`, FATAL branch, chained to the 404)."""
    if isinstance(exc, ClientLostError):
        return True
    if _status(exc) == 404:
        return True
    return isinstance(exc, ValueError) and _status(exc.__cause__) == 404


def is_poisoned(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "poisoned" in str(exc)


def is_retryable(exc: BaseException) -> bool:
    """Whether an idempotent request (sampling, save_state with overwrite, creating a client) may be sent
    again in place: any backend failure except one that says the client itself is unusable (poisoned, or
    lost: `is_lost`)."""
    return classify(exc) in (RESEND, RECOVER) and not is_poisoned(exc) and not is_lost(exc)


def is_not_applied(exc: BaseException) -> bool:
    return isinstance(exc, NOT_APPLIED)
