"""Hydra callbacks of train.py (registered under `hydra.callbacks` in conf/config.yaml).

Hydra creates the run folder, sets up its log file there and writes `.hydra/` before the task function
runs, so a folder that cannot be created or written fails inside Hydra with a traceback, before the
project's own checks. `on_run_start` / `on_multirun_start` run before that: the folder is probed here
and refused with one line and exit code 2 (`trainer.main.check_output_dir` repeats the probe for the
job's own folder)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def probe_output_dir(path: Path) -> str | None:
    """None when `path` exists (created if needed) and takes a file; else what went wrong."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"output folder {path} cannot be created ({e.strerror or e})"
    try:
        probe = path / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        return f"output folder {path} is not writable ({e.strerror or e})"
    return None


def _refuse_unusable(path: Path) -> None:
    problem = probe_output_dir(path)
    if problem is not None:
        print(f"error: {problem}; pass a writable folder as hydra.run.dir=<folder> (hydra.sweep.dir for "
              "--multirun)", file=sys.stderr)
        raise SystemExit(2)


class RunFolderCheck(Callback):
    """Refuse an output folder that cannot be created or written before Hydra writes into it."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_unusable(Path(str(config.hydra.run.dir)))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_unusable(Path(str(config.hydra.sweep.dir)))
