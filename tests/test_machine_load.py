"""The machine-load record beside every timing (trainer.utils.load): the arithmetic of a window, the fallback
without /proc/stat, one warning line per contended run, and the bench/ helper's lines. The /proc/stat the
unit tests read is a file they write in the kernel's format, so each window's load is known exactly."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import TINY, run_train

from trainer.utils.load import (
    BenchLoad,
    Counters,
    LoadMonitor,
    _machine_busy_s,
    describe,
    is_contended,
    window,
)

ROOT = Path(__file__).resolve().parents[1]

TCK = os.sysconf("SC_CLK_TCK")


def write_stat(path: Path, user: int, system: int = 0, idle: int = 10**6, steal: int = 0) -> None:
    """A /proc/stat in the kernel's layout (user nice system idle iowait irq softirq steal guest ...)."""
    path.write_text(f"cpu  {user} 7 {system} {idle} 50 3 2 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
                    "intr 12345\nctxt 999\n")


def test_proc_stat_busy_time_counts_user_nice_system_irq_softirq_steal_not_idle(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, user=1000, system=200, steal=40, idle=555555)
    assert _machine_busy_s(str(stat)) == pytest.approx((1000 + 7 + 200 + 3 + 2 + 40) / TCK)
    stat.write_text("intr 1\n")
    assert _machine_busy_s(str(stat)) is None


def test_window_subtracts_the_process_own_cpu_time():
    # 15 busy CPU seconds over 10 s, 5 of them this process's: 1 core busy elsewhere
    rec = window(Counters(100.0, 50.0, 1.0), Counters(110.0, 65.0, 6.0))
    cpus = os.cpu_count()
    assert rec["own_cores"] == pytest.approx(0.5)
    assert rec["other_cores"] == pytest.approx(1.0)
    assert rec["other_share"] == pytest.approx(round(1.0 / cpus, 3))
    assert rec["window_s"] == pytest.approx(10.0) and rec["cpus"] == cpus
    assert is_contended(rec) and f"1.00 of {cpus} CPUs busy in other processes over 10.0 s" in describe(rec)
    assert not is_contended(window(Counters(0.0, 0.0, 0.0), Counters(10.0, 4.0, 0.0)))  # 0.4 cores: quiet


def test_a_sweep_s_other_workers_are_recorded_apart_and_not_as_contention():
    """A parallel sweep's second worker is the sweep's own load: 30 s of machine time in a 10 s window, of
    which 10 s this process's and 12 s a sibling worker's (one that started inside the window counts whole):
    0.8 cores elsewhere, 1.2 in the sweep."""
    start = Counters(wall=100.0, machine_busy_s=1000.0, own_cpu_s=5.0, siblings_cpu_s={11: 50.0})
    end = Counters(wall=110.0, machine_busy_s=1030.0, own_cpu_s=15.0, siblings_cpu_s={11: 58.0, 12: 4.0})
    rec = window(start, end)
    assert rec["sweep_cores"] == pytest.approx(1.2) and rec["other_cores"] == pytest.approx(0.8)
    assert "1.20 in the sweep's other workers" in describe(rec)
    plain = window(Counters(100.0, 1000.0, 5.0), Counters(110.0, 1030.0, 15.0))
    assert "sweep_cores" not in plain and plain["other_cores"] == pytest.approx(2.0)


# a probe measuring one window with the sweep's workers counted apart and, over the same window, without
SWEEP_PROBE = "\n".join([
    "import dataclasses, json, time",
    "from trainer.utils.load import Counters, LoadMonitor, window",
    "auto = LoadMonitor(window_s=0.1).siblings",
    "a = Counters.now(siblings=True)",
    "time.sleep(1.0)",
    "b = Counters.now(siblings=True)",
    "strip = lambda c: dataclasses.replace(c, siblings_cpu_s=None)",
    "print(json.dumps({'auto': auto, 'with': window(a, b), 'without': window(strip(a), strip(b))}))",
])
# the launcher: a spinning worker, and the probe beside it as the other worker
SWEEP_PARENT = "\n".join([
    "import subprocess, sys, time",
    "spin = subprocess.Popen([sys.executable, '-c', 'while True: pass'])",
    "time.sleep(0.3)",
    "out = subprocess.run([sys.executable, '-c', sys.argv[1]], capture_output=True, text=True, check=True)",
    "spin.kill()",
    "print(out.stdout)",
])


@pytest.mark.parametrize("launcher", ["train.py", "other.py"])
def test_a_worker_of_a_sweep_launched_by_train_py_counts_its_fellow_worker_as_the_sweep_s(tmp_path, launcher):
    """The real /proc: a monitor whose parent is a train.py (a joblib sweep's launcher) reads the processes
    beside it as the sweep's other workers: a spinning sibling's core moves from `other_cores` to
    `sweep_cores` over the same window, whatever else loads the machine. Under any other parent the monitor
    does not look for siblings."""
    script = tmp_path / launcher
    script.write_text(SWEEP_PARENT)
    p = subprocess.run([sys.executable, str(script), SWEEP_PROBE], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["auto"] is (launcher == "train.py")
    with_, without = got["with"], got["without"]
    assert with_["sweep_cores"] >= 0.5 and "sweep_cores" not in without
    assert without["other_cores"] - with_["other_cores"] == pytest.approx(with_["sweep_cores"], abs=0.05)


def test_without_proc_stat_only_the_load_average_is_recorded(tmp_path):
    mon = LoadMonitor(stat_path=str(tmp_path / "missing"), window_s=0.01)
    rec = mon.end()
    for r in (rec["start"], rec["end"]):
        assert r["other_cores"] is None and r["other_share"] is None
        assert r["loadavg"] is None or len(r["loadavg"]) == 3
    assert rec["contended"] is False and rec["busiest"] is None
    assert "load average" in describe(rec["end"])


def test_a_contended_run_warns_once_naming_the_load_and_a_quiet_one_never(tmp_path, caplog):
    stat = tmp_path / "stat"
    write_stat(stat, user=1000)
    caplog.set_level(logging.WARNING, logger="pairedrl")
    mon = LoadMonitor(stat_path=str(stat), window_s=0.01)  # the file does not move: nobody else is busy
    assert mon.start_rec["other_cores"] == 0.0 and not caplog.records
    assert mon.check(0)["other_cores"] == 0.0 and not caplog.records
    for step in (1, 2):  # others took a million CPU seconds during each of these steps
        write_stat(stat, user=1000 + step * 10**6 * TCK)
        assert is_contended(mon.check(step))
    rec = mon.end()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("the machine is contended during step 1: ")
    assert "CPUs busy in other processes" in lines[0]
    assert "load average" in lines[0]
    assert rec["contended"] is True and rec["busiest"]["when"] in ("during step 1", "during step 2")
    assert rec["start"] == mon.start_rec and rec["end"]["other_cores"] > 0.5


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="Linux /proc/stat")
def test_a_busy_process_elsewhere_reads_as_busy_on_the_real_machine():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter starts
        rec = LoadMonitor(window_s=1.0).start_rec
    finally:
        child.kill()
        child.wait()
    # one spinning process: a whole core on an idle machine, at least half of one beside anything else
    assert rec["other_cores"] >= 0.5 and is_contended(rec)
    assert 0 <= rec["own_cores"] < 0.5  # the monitor slept through its window
    assert len(rec["loadavg"]) == 3


def test_bench_helper_prints_the_load_and_warns_only_when_contended(tmp_path):
    stat = tmp_path / "stat"
    write_stat(stat, user=1000)
    out = io.StringIO()
    with BenchLoad("x.py", window_s=0.01, stat_path=str(stat), out=out):
        pass
    text = out.getvalue()
    assert "[x.py] machine load at start: 0.00 of" in text and "[x.py] machine load at end" in text
    assert "WARNING" not in text
    out = io.StringIO()
    with BenchLoad("x.py", window_s=0.01, stat_path=str(stat), out=out):
        write_stat(stat, user=1000 + 10**6 * TCK)
    lines = out.getvalue().splitlines()
    want = ("[x.py] WARNING: more than 0.5 of a core was busy elsewhere; the timings above are not a quiet "
            "machine's")
    assert [ln for ln in lines if "WARNING" in ln] == [want]


def test_train_records_the_load_and_a_contended_run_logs_one_warning_line(tmp_path):
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a core busy elsewhere
    try:
        p = run_train([*TINY, "eval=none", f"hydra.run.dir={run_dir}"], tmp_path)
    finally:
        child.kill()
        child.wait()
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert out.count("the machine is contended") == 1, out[-3000:]
    assert "CPUs busy in other processes" in out
    load = json.loads((run_dir / "run_info.json").read_text())["load"]
    for when in ("start", "end"):
        assert len(load[when]["loadavg"]) == 3 and load[when]["other_cores"] >= 0
        assert 0 <= load[when]["other_share"] <= 1.5
    assert load["contended"] is True and load["busiest"]["other_cores"] > 0.5
    assert load["end"]["window_s"] > load["start"]["window_s"]  # the whole run, not the start window


def test_a_contended_start_warns_at_the_first_step_not_before(tmp_path, caplog, monkeypatch):
    """The start window's warning waits for the run's first step (or its end): a run refused before any step,
    such as a resume whose checkpoint is gone, writes no line into the folder's train.log."""
    import trainer.utils.load as load_mod

    busy = window(Counters(0.0, 0.0, 0.0), Counters(1.0, 1.9, 0.0))  # 1.9 cores elsewhere over one second
    assert is_contended(busy)
    monkeypatch.setattr(load_mod, "snapshot", lambda *a, **k: busy)
    stat = tmp_path / "stat"
    write_stat(stat, user=1000)
    caplog.set_level(logging.WARNING, logger="pairedrl")
    mon = LoadMonitor(stat_path=str(stat), window_s=0.01)
    assert not caplog.records  # nothing logged yet: the run may still be refused
    mon.check(0)
    mon.end()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("the machine is contended at the start of the run: "), lines
