"""Where per-update metrics go: metrics.jsonl (always, flushed per row) and optionally wandb."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from trainer.utils.io import JsonlAppender

log = logging.getLogger(__name__)


class MetricsSink:
    def __init__(self, run_dir: Path, logger_cfg: Any, run_name: str, config_dict: dict, sweep_dir: Path | None,
                 resume: bool) -> None:
        self.jsonl = JsonlAppender(run_dir / "metrics.jsonl")
        self.rollouts = JsonlAppender(run_dir / "rollouts.jsonl")
        self.wandb_run = None
        if logger_cfg.name == "wandb":
            self.wandb_run = self._init_wandb(run_dir, logger_cfg, run_name, config_dict, sweep_dir, resume)
            if resume:
                self._warn_redo("resumed")

    @staticmethod
    def _init_wandb(run_dir: Path, lc: Any, run_name: str, config_dict: dict, sweep_dir: Path | None,
                    resume: bool) -> Any:
        import wandb

        mode = lc.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        group = lc.group or (sweep_dir.name if sweep_dir else None)
        # a stable id per run folder, so a resumed run continues the same wandb run
        run_id = "pairedrl-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
        return wandb.init(project=lc.project, entity=lc.entity, group=group, name=run_name, id=run_id,
                          dir=str(run_dir), mode=mode, config=config_dict, resume="allow" if resume else None,
                          reinit=True)

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
            self.wandb_run.log({k: v for k, v in row.items() if isinstance(v, (int, float))},
                               step=int(row.get("global_update", 0)))

    def log_rollouts(self, rows: list[dict]) -> None:
        for r in rows:
            self.rollouts.write(r)

    def close(self) -> None:
        self.jsonl.close()
        self.rollouts.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
