"""Local checkpoint metadata (checkpoint.json) and the run-log repair that makes resume exact."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config.digest import config_hash  # noqa: F401 - the resume digest, re-exported for the loop
from trainer.utils.io import atomic_write_json, read_json, read_jsonl_lenient, rewrite_jsonl

CHECKPOINT_FILE = "checkpoint.json"


class ResumeError(RuntimeError):
    """The run folder's saved state cannot be resumed; nothing in it was modified."""


@dataclass
class CheckpointInfo:
    # opaque backend path of the saved state (weights + optimizer), e.g. tinker://...
    tinker_path: str
    # rollout steps completed when it was saved
    step: int
    # optimizer steps completed when it was saved
    optim_steps: int
    # index of the next train problem to use
    data_cursor: int
    # hash of the config parts that determine the computation
    config_hash: str
    # fingerprint of the python / numpy / torch RNG states, for the record only: nothing is restored from
    # it, since the loop derives every random draw from (seed, step, group)
    rng: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def rng_state() -> dict[str, Any]:
    return {
        "python": repr(random.getstate()),
        "numpy": np.random.get_state()[1][:4].tolist(),  # fingerprint; the loop derives seeds per step
        "torch": int(torch.initial_seed()),
    }


def save_checkpoint(run_dir: Path, info: CheckpointInfo) -> None:
    atomic_write_json(run_dir / CHECKPOINT_FILE, asdict(info))


def load_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    path = run_dir / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        d = read_json(path, "checkpoint metadata")
    except ValueError as e:
        raise ResumeError(str(e)) from None
    if not isinstance(d, dict):
        raise ResumeError(f"{path}: corrupt checkpoint metadata (not a JSON object)")
    missing = [k for k in ("tinker_path", "step", "optim_steps", "data_cursor", "config_hash") if k not in d]
    if missing:
        raise ResumeError(f"{path}: corrupt checkpoint metadata, missing keys {missing}")
    for k in ("step", "optim_steps", "data_cursor"):
        if not isinstance(d[k], int) or d[k] < 0:
            raise ResumeError(f"{path}: corrupt checkpoint metadata, bad {k} {d[k]!r}")
    return CheckpointInfo(**{k: d[k] for k in CheckpointInfo.__dataclass_fields__ if k in d})


def check_resumable(run_dir: Path, cfg_hash: str, rollouts_per_step: int = 0) -> CheckpointInfo | None:
    """Validate a run folder's saved state before anything is written to it.

    A resume redoes only the steps after the checkpoint, so the logs must hold every row of the steps
    before it: a row lost there (a deleted or truncated log) would be missing for good. Such a folder is
    refused; rows after the checkpoint, a torn last one included, are repaired by `truncate_log`.
    `rollouts_per_step`: the run's `logger.rollouts_per_step` (0: rollouts.jsonl is not expected to hold
    rows)."""
    ckpt = load_checkpoint(run_dir)
    if ckpt is not None and ckpt.config_hash != cfg_hash:
        raise ResumeError(
            f"{run_dir / CHECKPOINT_FILE} was written by a different config (hash {ckpt.config_hash} != "
            f"{cfg_hash}); refusing to resume into it. Use a new run folder.")
    logs = {}
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        try:
            logs[name] = read_jsonl_lenient(run_dir / name)
        except ValueError as e:
            raise ResumeError(str(e)) from None
    if ckpt is not None:
        _check_rows_before(run_dir / "metrics.jsonl", *logs["metrics.jsonl"], ckpt, per_update=True)
        if rollouts_per_step > 0 or logs["rollouts.jsonl"][0]:
            _check_rows_before(run_dir / "rollouts.jsonl", *logs["rollouts.jsonl"], ckpt, per_update=False)
    return ckpt


_STEP_FIELD = re.compile(r'"step":\s*(\d+)')


def _listed(numbers: list[int], most: int = 8) -> str:
    return ", ".join(map(str, numbers[:most])) + (", ..." if len(numbers) > most else "")


def _check_rows_before(path: Path, rows: list[dict], torn: int, ckpt: CheckpointInfo,
                       per_update: bool) -> None:
    """ResumeError unless `path` holds the rows of every step before the checkpoint: each update's row
    (metrics: `global_update` 0 .. optim_steps - 1), or at least one row per step (rollouts, whose count per
    step follows the resume-ignored `logger.rollouts_per_step`), and no torn last row of such a step."""
    before = [r for r in rows if isinstance(r.get("step"), int) and r["step"] < ckpt.step]
    refuse = (f"; refusing to resume: the steps before the checkpoint are not redone, so these rows would be "
              f"missing for good. Restore {path.name} from a copy, or start the run in a new folder")
    if per_update:
        seen = Counter(r.get("global_update") for r in before)
        missing = [u for u in range(ckpt.optim_steps) if u not in seen]
        if missing:
            raise ResumeError(f"{path} holds {ckpt.optim_steps - len(missing)} of the {ckpt.optim_steps} "
                              f"update rows of the {ckpt.step} steps before the checkpoint (missing "
                              f"global_update {_listed(missing)})" + refuse)
        twice = sorted(u for u, n in seen.items() if n > 1)
        if twice:  # a row written twice would count its update twice in every curve read from the log
            raise ResumeError(f"{path} holds {seen[twice[0]]} rows of global_update {twice[0]}"
                              f"{f' (and of {_listed(twice[1:])})' if twice[1:] else ''} before the checkpoint; "
                              f"refusing to resume: each update has one row. Restore {path.name} from a copy, "
                              "or start the run in a new folder")
    else:
        missing = sorted(set(range(ckpt.step)) - {r["step"] for r in before})
        if missing:
            raise ResumeError(f"{path} holds no row of step(s) {_listed(missing)} of the {ckpt.step} steps "
                              "before the checkpoint (a run that started with logger.rollouts_per_step=0 "
                              "resumes with the same)" + refuse)
    if torn and not per_update:  # (a torn metrics row before the checkpoint leaves a global_update missing)
        # the torn row follows the last complete one; it belongs to a step after the checkpoint only if
        # that row already does, or if its own fragment says so
        last = rows[-1].get("step", -1) if rows else -1
        frag = path.read_text().rstrip("\n").rsplit("\n", 1)[-1]
        m = _STEP_FIELD.search(frag)
        step = int(m.group(1)) if m else last
        if step < ckpt.step:
            raise ResumeError(f"{path}: its last line is torn and may be a row of step {step}, before the "
                              f"checkpoint (step {ckpt.step})" + refuse)


def truncate_log(path: Path, keep_steps_below: int) -> tuple[int, int]:
    """Keep only rows with step < keep_steps_below (they will be redone); repair a torn last line.

    Returns (rows kept, rows dropped)."""
    try:
        rows, torn = read_jsonl_lenient(path)
    except ValueError as e:
        raise ResumeError(str(e)) from None
    kept = [r for r in rows if int(r.get("step", -1)) < keep_steps_below]
    dropped = len(rows) - len(kept) + torn
    if dropped or torn:
        rewrite_jsonl(path, kept)
    return len(kept), dropped
