"""How busy the machine was beside a run or a measurement: the load average and the CPU time other processes
took, recorded next to every timing (run_info.json, bench/ output) so that a figure taken on a contended
machine says so.

Other processes' share comes from two counters read at the start and at the end of a window: the machine's
busy CPU time over all CPUs (/proc/stat, the `cpu` line: user + nice + system + irq + softirq + steal; steal
is time the hypervisor gave to other guests) minus this process's own CPU time (`resource.getrusage`, its
threads and its reaped children). Divided by the window's wall time it is the number of cores kept busy
elsewhere. Linux only: elsewhere (or with /proc unreadable) the busy-core figures are None and only the load
average, where the OS has one, is recorded.

A run that is one of a sweep's parallel workers (joblib starts one process per worker under the `train.py`
that launched the sweep) shares the machine with the sweep's other workers by design: their CPU time
(/proc/<pid>/stat of the processes with the same `train.py` parent) is recorded as `sweep_cores` and left out
of `other_cores`, so a two-worker sweep on two cores is not called contended by its own second worker. A
sibling that exits inside a window takes its time with it, which then counts as elsewhere (the safe side).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass
from typing import Any, Self

log = logging.getLogger("pairedrl")

# cores busy in other processes above which a timing is not a quiet machine's (one warning line)
BUSY_ELSEWHERE_WARN = 0.5
# the window of the start-of-run reading (the process sleeps through it, so its own share is ~0)
START_WINDOW_S = 0.5
_STAT_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal


def _machine_busy_s(stat_path: str = "/proc/stat") -> float | None:
    """Busy CPU seconds of all CPUs since boot, or None where /proc/stat cannot be read or parsed."""
    try:
        with open(stat_path) as f:
            first = f.readline().split()
        if not first or first[0] != "cpu":
            return None
        ticks = [int(x) for x in first[1:9]]
        return sum(ticks[i] for i in _STAT_BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _proc_stat_fields(path: str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(path) as f:
            text = f.read()
        return text[text.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def _launched_by_sweep(proc: str = "/proc") -> bool:
    """Whether this process's parent is a `train.py` (a sweep's launcher that runs its jobs in worker
    processes); a plain run's parent is a shell, a test runner or a terminal."""
    try:
        with open(f"{proc}/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return False
    return any(os.path.basename(a) == "train.py" for a in argv[:3])


def _sibling_cpu_s(proc: str = "/proc") -> dict[int, float]:
    """CPU seconds (user + system, with reaped children) of each other process that shares this one's parent."""
    me, parent, tck = os.getpid(), os.getppid(), os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        pids = [int(d) for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == me:
            continue
        f = _proc_stat_fields(f"{proc}/{pid}/stat")
        # after the name: state ppid ... utime(12) stime(13) cutime(14) cstime(15), counted from state = 0
        if f is None or len(f) < 16 or not f[1].lstrip("-").isdigit() or int(f[1]) != parent:
            continue
        try:
            out[pid] = sum(int(x) for x in f[11:15]) / tck
        except ValueError:
            continue
    return out


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Counters:
    """One reading of the counters a window is measured between."""

    wall: float
    machine_busy_s: float | None
    own_cpu_s: float
    # CPU seconds of each of the sweep's other workers, or None outside a parallel sweep
    siblings_cpu_s: dict[int, float] | None = None

    @classmethod
    def now(cls, stat_path: str = "/proc/stat", siblings: bool = False) -> Counters:
        return cls(time.monotonic(), _machine_busy_s(stat_path), _own_cpu_s(),
                   _sibling_cpu_s() if siblings else None)


def window(start: Counters, end: Counters) -> dict[str, Any]:
    """The machine's load between two readings: load average at the end, cores busy in other processes and
    in this one, the share of the CPUs the others used (None where /proc/stat is missing)."""
    wall = max(end.wall - start.wall, 1e-9)
    own = max(end.own_cpu_s - start.own_cpu_s, 0.0)
    cpus = os.cpu_count()
    out: dict[str, Any] = {"loadavg": load_average(), "window_s": round(wall, 3), "cpus": cpus,
                           "own_cores": round(own / wall, 3), "other_cores": None, "other_share": None}
    sweep = 0.0
    if start.siblings_cpu_s is not None and end.siblings_cpu_s is not None:
        # a worker absent at the start began inside the window: all of its time is the window's
        sweep = sum(max(t - start.siblings_cpu_s.get(pid, 0.0), 0.0) for pid, t in end.siblings_cpu_s.items())
        out["sweep_cores"] = round(sweep / wall, 3)
    if start.machine_busy_s is not None and end.machine_busy_s is not None:
        # clock ticks are coarse (10 ms): a short window can read a little below the process's own time
        other = max(end.machine_busy_s - start.machine_busy_s - own - sweep, 0.0) / wall
        out["other_cores"] = round(other, 3)
        out["other_share"] = round(other / cpus, 3) if cpus else None
    return out


def snapshot(window_s: float = START_WINDOW_S, stat_path: str = "/proc/stat",
             siblings: bool = False) -> dict[str, Any]:
    """The load now: a `window` over `window_s` seconds of sleep."""
    start = Counters.now(stat_path, siblings)
    time.sleep(window_s)
    return window(start, Counters.now(stat_path, siblings))


def is_contended(rec: dict[str, Any] | None) -> bool:
    other = (rec or {}).get("other_cores")
    return isinstance(other, (int, float)) and other > BUSY_ELSEWHERE_WARN


def describe(rec: dict[str, Any]) -> str:
    """'1.62 of 2 CPUs busy in other processes over 12.0 s, load average 3.10 2.40 1.20' (what is known)."""
    parts = []
    if rec.get("other_cores") is not None:
        cpus, over = rec.get("cpus") or "?", rec["window_s"]
        parts.append(f"{rec['other_cores']:.2f} of {cpus} CPUs busy in other processes over {over:.1f} s")
        if rec.get("sweep_cores") is not None:
            parts.append(f"{rec['sweep_cores']:.2f} in the sweep's other workers")
    la = rec.get("loadavg")
    parts.append("load average " + (" ".join(f"{x:.2f}" for x in la) if la else "unknown"))
    return ", ".join(parts)


class LoadMonitor:
    """A run's load record: `start` (a short window as the run begins), `check` after each step (one warning
    line, the first time a window shows more than BUSY_ELSEWHERE_WARN cores busy elsewhere), and `end` (the
    whole run since `start`, plus the last step's window)."""

    def __init__(self, stat_path: str = "/proc/stat", window_s: float = START_WINDOW_S,
                 siblings: bool | None = None) -> None:
        self.stat_path = stat_path
        # one of a sweep's parallel workers: its fellow workers are the sweep's, not other load
        self.siblings = _launched_by_sweep() if siblings is None else siblings
        self.start_rec = snapshot(window_s, stat_path, self.siblings)
        self._t0 = self._last = Counters.now(stat_path, self.siblings)
        self.warned: str | None = None
        self.worst: dict[str, Any] | None = None
        # the start window's warning waits for the first step: a run refused before it (a resume whose
        # checkpoint is gone) leaves its folder, train.log included, as it found it
        self._start_pending = True

    def _warn_start(self) -> None:
        if self._start_pending:
            self._start_pending = False
            self._maybe_warn(self.start_rec, "at the start of the run")

    def _maybe_warn(self, rec: dict[str, Any], when: str) -> None:
        if is_contended(rec) and (self.worst is None or rec["other_cores"] > self.worst["other_cores"]):
            self.worst = {**rec, "when": when}
        if self.warned is None and is_contended(rec):
            self.warned = (f"the machine is contended {when}: {describe(rec)}; this run's timings are not a "
                           f"quiet machine's (results do not depend on it)")
            log.warning("%s", self.warned)

    def check(self, step: int) -> dict[str, Any]:
        """The window since the previous check (a rollout step and what ran at its end)."""
        self._warn_start()
        now = Counters.now(self.stat_path, self.siblings)
        rec = window(self._last, now)
        self._last = now
        self._maybe_warn(rec, f"during step {step}")
        return rec

    def end(self) -> dict[str, Any]:
        """The record for run_info.json's `load`: start, the whole run, the busiest window, and whether the
        run warned."""
        self._warn_start()
        run = window(self._t0, Counters.now(self.stat_path, self.siblings))
        self._maybe_warn(run, "over the run")
        return {"start": self.start_rec, "end": run, "busiest": self.worst,
                "contended": self.warned is not None, "warn_above_other_cores": BUSY_ELSEWHERE_WARN}


class BenchLoad:
    """For bench/ scripts: prints the load as the measurement starts and over the whole measurement at the
    end, each with a WARNING line when more than BUSY_ELSEWHERE_WARN cores were busy elsewhere."""

    def __init__(self, name: str, window_s: float = START_WINDOW_S, stat_path: str = "/proc/stat",
                 out: Any = None) -> None:
        self.name, self.stat_path, self.out = name, stat_path, out
        self.start_rec = snapshot(window_s, stat_path)
        self._t0 = Counters.now(stat_path)
        self._say("start", self.start_rec, "that follow")

    def _say(self, when: str, rec: dict[str, Any], which: str) -> None:
        print(f"[{self.name}] machine load at {when}: {describe(rec)}", file=self.out, flush=True)
        if is_contended(rec):
            print(f"[{self.name}] WARNING: more than {BUSY_ELSEWHERE_WARN} of a core was busy elsewhere; the "
                  f"timings {which} are not a quiet machine's", file=self.out, flush=True)

    def end(self) -> dict[str, Any]:
        rec = window(self._t0, Counters.now(self.stat_path))
        self._say("end (whole measurement)", rec, "above")
        return rec

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
