"""What a session's end does to its work on the engine, and how much work is in flight.

A session that ends (finished by its client, or expired when its requests and heartbeats stop) must not
leave its work running: a key could otherwise queue hours of decoding and walk away, and other keys would
wait behind it. `stop_work` cancels each engine object the session held (`cancel()`: the local engine's
training and sampling clients), then closes it: queued requests never start, running sampling stops at
its batch's next decode slice (`SLICE_S`), running training before its next micro-batch. Their futures
fail with `RequestCancelled`, and the server's per-key in-flight count drops as each one does.
"""

from __future__ import annotations

import threading
from typing import Any


def stop_work(obj: Any) -> None:
    """Cancel the queued and running work of a released training or sampling client, then close it."""
    cancel = getattr(obj, "cancel", None)
    if callable(cancel):
        cancel()
    close = getattr(obj, "close", None)
    if callable(close):
        close()


def work_stats(engine: Any, inflight: dict[str, int], lock: threading.RLock) -> dict[str, Any]:
    """/stats' server-wide view of work in flight: accepted requests not done (all keys together; each key
    sees its own under `key.inflight`), and what the engine's sampler is queuing and decoding now."""
    with lock:  # the counts change on engine threads (`futures.FutureTable`)
        total = sum(inflight.values())
    load = engine.sampler_load() if hasattr(engine, "sampler_load") else {}
    return {"inflight": total, "sampler": load}
