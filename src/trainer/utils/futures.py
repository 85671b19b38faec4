"""Chaining on `concurrent.futures.Future`, shared by the local engine's clients and the Tinker server."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable


def then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of `fn(result)` once `fut` is done; an exception of `fut` or of `fn` is passed on."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            out.set_exception(e)

    fut.add_done_callback(done)
    return out
