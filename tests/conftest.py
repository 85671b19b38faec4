"""Shared fixtures: the src/ layout on sys.path, offline env, the precision the suite runs in, and
`train_in_process` (train.py's Hydra entry point run inside the test process).

`--precision float32|bfloat16` (or PAIREDRL_AUTO_PRECISION in the environment) sets what the engine's
`auto` precision means for the whole run, subprocesses included, so the bf16 path can be checked on an
AVX2-only CPU and the fp32 path on a bf16 CPU. Tests that name a precision keep it. Tests marked `bf16`
are about the bf16 path and run only where bf16 matmuls are fast, or when bf16 is forced."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("WANDB_MODE", "offline")


def pytest_addoption(parser):
    parser.addoption("--precision", choices=("auto", "float32", "bfloat16"),
                     default=os.environ.get("PAIREDRL_AUTO_PRECISION") or "auto",
                     help="what the local engine's `auto` precision resolves to in this run (default: measured on this CPU)")


def pytest_configure(config):
    config.addinivalue_line("markers", "bf16: about the bf16 path; skipped where bf16 matmuls are not faster "
                                       "than fp32 (measured) unless --precision bfloat16")
    forced = config.getoption("--precision")
    if forced == "auto":
        os.environ.pop("PAIREDRL_AUTO_PRECISION", None)
    else:
        os.environ["PAIREDRL_AUTO_PRECISION"] = forced


def pytest_report_header(config):
    from trainer.backends.local.plan import auto_dtype
    from trainer.backends.local.precision import dtype_name

    dtype, why = auto_dtype()
    return f"pairedrl: backend precision `auto` = {dtype_name(dtype)} ({why})"


def pytest_collection_modifyitems(config, items):
    from trainer.backends.local.plan import measured_dtype

    if config.getoption("--precision") == "bfloat16" or measured_dtype()[0] == "bfloat16":
        return
    skip = pytest.mark.skip(reason="bf16 path: bf16 matmuls are not faster than fp32 on this CPU (measured), so "
                                   "`auto` never picks bf16 here; --precision bfloat16 runs it anyway")
    for item in items:
        if "bf16" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """The root logger's handlers and level as they were before the test. An entry point run in-process
    (Hydra's job logging, a `main()`'s basicConfig) gives the root logger handlers on this test's captured
    streams; left in place they write to closed files in later tests, where any stray record (a background
    thread's warning) prints a logging traceback into that test's stderr."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


@pytest.fixture
def train_in_process(capfd, monkeypatch):
    """`train_in_process(args, cwd)`: `python train.py *args` run inside this process (the same Hydra entry
    point, argv and cwd), returning (exit code, stdout + stderr). The bad-input corpus runs this way because
    each subprocess spent seconds importing torch/transformers/tinker before failing; `tests/test_config.py`
    and the read-only folder case still go through a real subprocess. `runs.train_entry` is the same run for
    a fixture of wider scope."""
    from runs import train_entry

    def run(args: list[str], cwd: Path) -> tuple[int, str]:
        capfd.readouterr()
        code = train_entry(args, cwd, monkeypatch)
        out = capfd.readouterr()
        return code, out.out + out.err

    return run
