"""Where per-update metrics go: metrics.jsonl (always, flushed per row) and optionally wandb."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.utils.io import JsonlAppender

if TYPE_CHECKING:
    from trainer.config.schema import LoggerConfig

log = logging.getLogger(__name__)


class MetricsSink:
    """metrics.jsonl / rollouts.jsonl, and the wandb run when logger=wandb.

    `wandb_run` is the run opened by train.py (which also logs the evals to it and finishes it); without
    one and with logger=wandb the sink opens its own and finishes it on close."""

    def __init__(self, run_dir: Path, logger_cfg: LoggerConfig, run_name: str, config_dict: dict,
                 sweep_dir: Path | None,
                 resume: bool, wandb_run: Any = None, updates_per_batch: int = 1) -> None:
        self.jsonl = JsonlAppender(run_dir / "metrics.jsonl")
        self.rollouts = JsonlAppender(run_dir / "rollouts.jsonl")
        self.wandb_run = wandb_run
        self._owns_wandb = False
        if wandb_run is None and logger_cfg.name == "wandb":
            from trainer.wandb_run import WandbRun

            self.wandb_run = WandbRun(run_dir, logger_cfg, run_name, config_dict, sweep_dir, resume,
                                      updates_per_batch)
            self._owns_wandb = True
        if resume:
            self._warn_redo("resumed")

    def reopen(self) -> None:
        """After the logs were truncated to the last checkpoint (a recovery): append from there."""
        for name in ("jsonl", "rollouts"):
            f = getattr(self, name)
            f.close()
            setattr(self, name, JsonlAppender(f.path))
        self._warn_redo("recovered from its last checkpoint")

    def _warn_redo(self, what: str) -> None:
        if self.wandb_run is not None:
            # wandb refuses steps below its current one and cannot rewind an offline run
            log.warning("the run %s: updates after its checkpoint are redone; wandb keeps the values first "
                        "logged for them, metrics.jsonl holds the redone ones (identical on the local engine)",
                        what)

    def log(self, row: dict[str, Any]) -> None:
        self.jsonl.write(row)
        if self.wandb_run is not None:
            self.wandb_run.log_update(row)

    def log_rollouts(self, rows: list[dict], step: int = 0, global_update: int = 0) -> None:
        for r in rows:
            self.rollouts.write(r)
        if self.wandb_run is not None:
            self.wandb_run.log_rollouts(rows, step, global_update)

    def close(self) -> None:
        self.jsonl.close()
        self.rollouts.close()
        if self._owns_wandb:
            self.wandb_run.finish()
