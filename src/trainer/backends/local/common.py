"""Plumbing shared by the local clients: futures, ordered workers, checkpoint paths, injected faults."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from trainer.backends.errors import TransientBackendError

T = TypeVar("T")
PATH_PREFIX = "tinker://local/"


def done_future(value: Any) -> AwaitableConcurrentFuture:
    f: Future = Future()
    f.set_result(value)
    return AwaitableConcurrentFuture(f)


def failed_future(exc: BaseException) -> AwaitableConcurrentFuture:
    f: Future = Future()
    f.set_exception(exc)
    return AwaitableConcurrentFuture(f)


class SelfFuture:
    """tinker 0.38 backcompat: a client-creating call returns an object that is both the client and
    an `APIFuture` of it (`BackcompatTrainingClientFuture` / `BackcompatSamplingClientFuture`)."""

    def _ready(self, timeout: float | None = None) -> None:  # overridden where creation is deferred
        return None

    def result(self, timeout: float | None = None) -> Any:
        self._ready(timeout)
        return self

    async def result_async(self, timeout: float | None = None) -> Any:
        import asyncio

        await asyncio.to_thread(self._ready, timeout)
        return self

    def future(self) -> Future:
        f: Future = Future()
        f.set_result(self.result())
        return f

    async def coroutine(self) -> Any:
        return await self.result_async()

    def __await__(self):
        return self.result_async().__await__()


class ComputeThread:
    """The one thread on which all of the engine's torch work runs (sampling, forward/backward, optim).

    torch's OpenMP pool belongs to the thread that opens a parallel region: once a second thread has
    its own pool, the two pools compete for the cores and the same kernels run slower (`bench/threads.py`
    times a decode step on the only pool's thread and beside a second pool). So model
    loading, sampling and training all run on this one thread, and the engine never opens a parallel
    region on the caller's thread; a call made from the compute thread itself runs inline, so nested
    calls cannot deadlock."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-compute")
        self._ident: int | None = None

    def _enter(self, fn: Callable[[], T]) -> T:
        self._ident = threading.get_ident()
        return fn()

    def run(self, fn: Callable[[], T]) -> T:
        if threading.get_ident() == self._ident:
            return fn()
        return self._pool.submit(self._enter, fn).result()


COMPUTE = ComputeThread()


class OrderedWorker:
    """One thread per client: requests run in submission order, as Tinker orders a client's requests."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], T]) -> AwaitableConcurrentFuture:
        return AwaitableConcurrentFuture(self._pool.submit(fn))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=False)


def tinker_path(folder: Path) -> str:
    return PATH_PREFIX + str(Path(folder).resolve()).lstrip("/")


def parse_path(path: str) -> Path:
    """`tinker://local/<absolute dir>` -> the folder; anything else is a clear ValueError."""
    if not isinstance(path, str) or not path.startswith(PATH_PREFIX):
        raise ValueError(f"local engine checkpoint paths look like {PATH_PREFIX}<absolute dir>, got {path!r}")
    folder = Path("/" + path[len(PATH_PREFIX):].lstrip("/"))
    if not (folder / "meta.json").is_file():
        raise ValueError(f"no local-engine checkpoint at {path!r} ({folder}/meta.json missing)")
    return folder


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or name.startswith("."):
        raise ValueError(f"checkpoint name must be a plain non-empty file name, got {name!r}")
    return name


FAULT_KINDS = {"sample": "p_sample", "forward_backward": "p_forward_backward", "optim_step": "p_optim_step",
               "save_state": "p_save_state"}


class Faults:
    """Seeded fault injection: `{p_sample, p_forward_backward, p_optim_step, p_save_state: probability,
    latency_s: seconds, seed}`. Draws happen at submission, in order, so a run's fault pattern is
    reproducible; a failing call raises `TransientBackendError` before doing any work."""

    def __init__(self, cfg: dict[str, Any] | None):
        cfg = dict(cfg or {})
        unknown = set(cfg) - set(FAULT_KINDS.values()) - {"latency_s", "seed"}
        if unknown:
            raise ValueError(f"faults: unknown keys {sorted(unknown)}; expected {sorted(FAULT_KINDS.values())}, "
                             "latency_s, seed")
        self.p = {k: float(cfg.get(v, 0.0)) for k, v in FAULT_KINDS.items()}
        for k, p in self.p.items():
            if not 0.0 <= p < 1.0:
                raise ValueError(f"faults.{FAULT_KINDS[k]} must be in [0, 1), got {p}")
        self.latency_s = float(cfg.get("latency_s", 0.0))
        if self.latency_s < 0:
            raise ValueError(f"faults.latency_s must be >= 0, got {self.latency_s}")
        self._rng = random.Random(int(cfg.get("seed", 0)))
        self._lock = threading.Lock()
        self.injected = {k: 0 for k in FAULT_KINDS}

    def draw(self, kind: str) -> bool:
        """Whether the call of `kind` being submitted now will fail."""
        p = self.p.get(kind, 0.0)
        if p <= 0.0:
            return False
        with self._lock:
            fail = self._rng.random() < p
            if fail:
                self.injected[kind] += 1
        return fail

    def apply(self, kind: str, fail: bool, latency: bool = True) -> None:
        """At execution: the configured latency, then the failure if one was drawn."""
        if latency and self.latency_s > 0:
            time.sleep(self.latency_s)
        if fail:
            raise TransientBackendError(f"injected fault: {kind} failed before doing any work (local engine faults)")
