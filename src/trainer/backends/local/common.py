"""Plumbing shared by the local clients: futures, ordered workers, checkpoint paths, injected faults."""

from __future__ import annotations

import os
import random
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from trainer.backends.errors import TransientBackendError

T = TypeVar("T")
# the legacy local form `tinker://local/<absolute dir>`, found in older runs' checkpoint.json
LEGACY_PREFIX = "tinker://local/"


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


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere): freed
    tensors otherwise stay in the process's RSS, which a server's memory figure then overstates."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass


def process_memory_mb() -> dict[str, float]:
    """This process's resident memory now and at its peak (MiB), from /proc (empty where there is none)."""
    out: dict[str, float] = {}
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        for field, key in (("VmRSS:", "rss_mb"), ("VmHWM:", "peak_rss_mb")):
            if line.startswith(field):
                out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


class RequestCancelled(RuntimeError):
    """The request's client was cancelled (a server's session ended) before its work finished: a queued
    request never starts, a running sampling batch stops at its next decode slice, a running training
    request between two micro-batches."""


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

    def waiting(self) -> bool:
        """Whether work is queued behind the running call (a long call then yields its turn: `sampling`)."""
        return not self._pool._work_queue.empty()


COMPUTE = ComputeThread()


class OrderedWorker:
    """One thread per client: requests run in submission order, as Tinker orders a client's requests."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[[], T]) -> AwaitableConcurrentFuture:
        return AwaitableConcurrentFuture(self._pool.submit(fn))

    def shutdown(self, cancel_queued: bool = False) -> None:
        """No more requests; those queued still run, or (`cancel_queued`) are cancelled, never started."""
        self._pool.shutdown(wait=False, cancel_futures=cancel_queued)


#: checkpoint kind -> the path segment naming it, from the SDK's parser
#: (`tinker/types/checkpoint.py::ParsedCheckpointTinkerPath.from_tinker_path`, `segment_to_type`)
SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
_KIND_OF_SEGMENT = {v: k for k, v in SEGMENTS.items()}
# run ids and checkpoint names become folder names under the state dir: a short plain name, never
# `.`/`..`, never a separator, never a leading dot (temp folders start with one)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+-]{0,127}")
MAX_PATH = 1024


class CheckpointPathError(ValueError):
    """A checkpoint path the engine will not load; `status` is the HTTP status a server answers with
    (400 malformed, 404 not found). A path outside the state dir gets the same 404 as a missing one, so
    the answer says nothing about which files exist."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def check_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value) or ".." in value:
        raise ValueError(f"{what} must be 1-128 characters of letters, digits and ._:+- not starting with "
                         f"'.' or containing '..', got {str(value)[:200]!r}")
    return value


def check_name(name: str) -> str:
    return check_id(name, "checkpoint name")


def tinker_path(run_id: str, kind: str, name: str) -> str:
    """`tinker://<run_id>/<weights|sampler_weights|external_weights>/<name>`: the SDK's form."""
    return f"tinker://{run_id}/{SEGMENTS[kind]}/{name}"


def checkpoint_folder(state_dir: Path, run_id: str, kind: str, name: str) -> Path:
    return Path(state_dir) / check_id(run_id, "run id") / SEGMENTS[kind] / check_name(name)


def parse_tinker_path(path: Any) -> tuple[str, str, str]:
    """(run_id, kind, name) of an SDK-form path; CheckpointPathError(400) for anything else."""
    if not isinstance(path, str) or len(path) > MAX_PATH:
        raise CheckpointPathError(f"checkpoint path must be a string of at most {MAX_PATH} characters", 400)
    parts = path[len("tinker://"):].split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in _KIND_OF_SEGMENT:
        raise CheckpointPathError(f"checkpoint paths look like tinker://<run_id>/weights/<name> or "
                                  f"tinker://<run_id>/sampler_weights/<name>, got {path[:200]!r}", 400)
    try:
        check_id(parts[0], "run id")
        check_name(parts[2])
    except ValueError as e:
        raise CheckpointPathError(f"{path[:200]!r}: {e}", 400) from None
    return parts[0], _KIND_OF_SEGMENT[parts[1]], parts[2]


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def resolve_path(path: Any, state_dir: Path, kinds: tuple[str, ...] = ("training", "sampler")) -> Path:
    """The checkpoint folder a path names, confined to `state_dir`.

    SDK form: `tinker://<run_id>/<segment>/<name>` -> `<state_dir>/<run_id>/<segment>/<name>`. The legacy
    form, `tinker://local/<absolute dir>`, loads when that folder lies inside the state dir
    (a resumed run's `checkpoint.json` names one); otherwise it is refused with how to convert it. The
    folder is resolved (symlinks followed) and must stay inside the state dir; a path that escapes, a
    missing folder and a folder without `meta.json` all get the same CheckpointPathError(404)."""
    root = Path(state_dir).resolve()
    if isinstance(path, str) and path.startswith(LEGACY_PREFIX) and len(path) <= MAX_PATH:
        lexical = Path(os.path.normpath("/" + path[len(LEGACY_PREFIX):].lstrip("/")))
        if not _inside(lexical, root) or len(lexical.relative_to(root).parts) != 3:
            raise CheckpointPathError(
                f"{path[:200]!r} is a legacy local path outside this engine's state dir; checkpoint paths "
                "look like tinker://<run_id>/weights/<name> and name a folder under this engine's state dir "
                "(<state dir>/<run_id>/weights/<name>): copy the checkpoint folder there and use that path", 404)
        folder = lexical
        kind = _KIND_OF_SEGMENT.get(folder.parent.name)
        if kind is None:
            raise CheckpointPathError(f"no checkpoint {path[:200]!r} on this server", 404)
    else:
        run_id, kind, name = parse_tinker_path(path)
        folder = root / run_id / SEGMENTS[kind] / name
    if kind not in kinds:
        raise CheckpointPathError(f"{path[:200]!r} is a {kind} checkpoint; this call loads "
                                  f"{' or '.join(SEGMENTS[k] for k in kinds)} checkpoints", 400)
    real = folder.resolve()
    meta = real / "meta.json"
    if not (_inside(real, root) and meta.is_file() and _inside(meta.resolve(), root)):
        raise CheckpointPathError(f"no checkpoint {path[:200]!r} on this server", 404)
    return real


FAULT_KINDS = {"sample": "p_sample", "forward_backward": "p_forward_backward", "optim_step": "p_optim_step",
               "save_state": "p_save_state"}


class Faults:
    """Seeded fault injection: `{p_sample, p_forward_backward, p_optim_step, p_save_state: probability,
    latency_s: seconds, seed}`. Draws happen at submission, in order, so a run's fault pattern is
    reproducible; a failing call raises `TransientBackendError` before doing any work."""

    def __init__(self, spec: dict[str, Any] | None):
        # the engine's own keyword (LocalServiceClient(faults=...)); train.py passes backend.faults' fields
        spec = dict(spec or {})
        unknown = set(spec) - set(FAULT_KINDS.values()) - {"latency_s", "seed"}
        if unknown:
            raise ValueError(f"faults: unknown keys {sorted(unknown)}; expected {sorted(FAULT_KINDS.values())}, "
                             "latency_s, seed")
        self.p = {k: float(spec.get(v, 0.0)) for k, v in FAULT_KINDS.items()}
        for k, p in self.p.items():
            if not 0.0 <= p < 1.0:
                raise ValueError(f"faults.{FAULT_KINDS[k]} must be in [0, 1), got {p}")
        self.latency_s = float(spec.get("latency_s", 0.0))
        if self.latency_s < 0:
            raise ValueError(f"faults.latency_s must be >= 0, got {self.latency_s}")
        self._rng = random.Random(int(spec.get("seed", 0)))
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
