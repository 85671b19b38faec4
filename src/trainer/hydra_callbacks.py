"""Hydra callbacks of train.py (registered under `hydra.callbacks` in conf/config.yaml).

Hydra creates the run folder, sets up its log file there and writes `.hydra/` before the task function
runs, so a folder that cannot be created or written fails inside Hydra with a traceback, before the
project's own checks. `on_run_start` / `on_multirun_start` run before that: the folder is probed here
and refused with one line and exit code 2 (`trainer.main.check_output_dir` repeats the probe for the
job's own folder).

`SweepRecord.on_multirun_start` writes the sweep's membership (every job's overrides, in Hydra's job
order, the arms, the seeds and a hash of them) to `<sweep>/sweep.json` before any job starts; each job
copies it into its run_info.json (`sweep`, with its own job number), so the record of which runs one launch
made travels with each run and compare names a subset of a sweep without the sweep's folder."""

from __future__ import annotations

import hashlib
import json
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


#: the file of a sweep folder that lists its jobs (SweepRecord)
SWEEP_RECORD = "sweep.json"


def sweep_membership(params: dict[str, Any], task_overrides: list[str]) -> dict[str, Any]:
    """The jobs of a --multirun as Hydra's BasicSweeper launches them (the config's hydra.sweeper.params,
    then the command line's overrides, expanded by `BasicSweeper.split_arguments` in its order, which is the
    job number), their arms (a job's overrides without `seed=`), their seeds, and the sha256 of the job
    list. Secret-looking override values are redacted before anything is hashed or written."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.run_info import current_secrets, redact_argv

    args = [f"{k}={v}" for k, v in params.items()] + [str(x) for x in task_overrides]
    batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
    secrets = current_secrets()
    jobs = [redact_argv(list(job), secrets) for batch in batches for job in batch]
    seeds = sorted({o.split("=", 1)[1] for job in jobs for o in job if o.startswith("seed=")})
    arms = sorted({" ".join(o for o in job if not o.startswith("seed=")) for job in jobs})
    sha = hashlib.sha256(json.dumps(jobs).encode()).hexdigest()
    return {"jobs": jobs, "arms": arms, "seeds": seeds, "sha256": sha}


class SweepRecord(Callback):
    """Record a --multirun's membership in <sweep>/sweep.json before its jobs start (module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from trainer.utils.io import atomic_write_json

        hc = config.hydra
        params = {str(k): str(v) for k, v in (hc.sweeper.get("params") or {}).items()}
        try:
            record = sweep_membership(params, list(hc.overrides.task))
        except Exception as e:  # noqa: BLE001 - another sweeper's syntax: the runs then carry no membership
            record = {"unrecorded": f"{type(e).__name__}: {e}"}
        sweep = Path(str(hc.sweep.dir))
        sweep.mkdir(parents=True, exist_ok=True)
        atomic_write_json(sweep / SWEEP_RECORD, record)
