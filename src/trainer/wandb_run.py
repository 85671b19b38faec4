"""One arm's Weights & Biases run: training metrics, eval curves, eval and rollout tables, summary.

Axes. wandb's own step (`_step`) is the global optimizer update, as in metrics.jsonl. `step` (the
rollout step whose weights produced a value) is declared with `define_metric` as the x-axis of
`eval/*`, `env/*` and `rollouts/*`, so eval accuracy and reward share one axis: the eval at step k
grades the weights after k rollout steps, the same weights that sample step k's rollouts. An eval
at step k is also logged at `_step = k * updates_per_batch`, the first update of step k, so the
two axes agree.

Resume. Which evals were already logged is kept in `<run>/wandb_evals.json`: a resumed run logs
only the evals it has not, so no eval row is ever duplicated (training rows redone after a
checkpoint are the loop's concern; see MetricsSink).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.run_info import current_secrets, redact_argv
from trainer.utils.io import atomic_write_json

if TYPE_CHECKING:
    from trainer.config.schema import LoggerConfig

log = logging.getLogger(__name__)

EVAL_LEDGER = "wandb_evals.json"
# columns of the per-step rollout table and of the final eval's per-item table
ROLLOUT_COLUMNS = ("step", "group", "prompt", "completion", "parsed", "gold", "correct", "reward", "advantage",
                   "stop_reason")
EVAL_COLUMNS = ("index", "prompt", "completion", "parsed", "gold", "correct", "correct_at_start", "reward",
                "n_tokens", "stop_reason")
_STEP_AXIS_KEYS = ("eval/*", "env/*", "rollouts/*")


def run_id(run_dir: Path, prefix: str = "pairedrl") -> str:
    """A stable id per folder, so a resumed run (or a rerun compare) continues the same wandb run."""
    return f"{prefix}-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def init_redacted(**kwargs: Any) -> Any:
    """`wandb.init(**kwargs)` with the command line's secrets redacted: wandb records `sys.argv` (read during
    init) in the run's metadata, which `wandb sync` uploads, so it sees the arguments as config.yaml holds
    them. Every wandb run of the project (training arms, compare runs) starts here."""
    import wandb

    argv = sys.argv
    sys.argv = [argv[0], *redact_argv(argv[1:], current_secrets())] if argv else argv
    try:
        return wandb.init(**kwargs)
    finally:
        sys.argv = argv


def resolve_mode(mode: str) -> str:
    """The mode passed to `wandb.init`. `WANDB_MODE=offline` (or `disabled`) in the environment wins over
    any configured mode: wandb.init's own `mode` argument would otherwise override it, and a key in
    `WANDB_API_KEY` would take `auto` online on a machine the user meant to keep offline. Otherwise `auto`
    follows `WANDB_MODE` when set, else goes online only with a key."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in ("offline", "dryrun"):
        return "offline"
    if env == "disabled":
        return "disabled"
    if mode == "auto":
        if env == "online":
            return "online"
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return mode


class WandbRun:
    """The wandb run of one training run folder (arm x seed)."""

    def __init__(self, run_dir: Path, lc: LoggerConfig, run_name: str, config_dict: dict,
                 sweep_dir: Path | None,
                 resume: bool, updates_per_batch: int) -> None:

        self.run_dir = Path(run_dir)
        self.updates_per_batch = max(1, int(updates_per_batch))
        group = lc.group or (sweep_dir.name if sweep_dir else None)
        loss = (config_dict.get("loss") or {}).get("name")
        # arm / loss / seed at the top level, so wandb's grouping and filters can use them directly
        config = {**config_dict, "arm": run_name, "loss_name": loss, "seed": config_dict.get("seed")}
        self.run = init_redacted(project=lc.project, entity=lc.entity, group=group, name=run_name,
                                 id=run_id(self.run_dir), dir=str(self.run_dir), mode=resolve_mode(lc.mode),
                                 config=config, job_type="train", tags=[f"loss:{loss}"],
                                 resume="allow" if resume else None,
                                 # several runs may live in one process (the preflight pilot, tests):
                                 # each init makes its own run and leaves the others alone
                                 reinit="create_new")
        self.run.define_metric("step")
        for pattern in _STEP_AXIS_KEYS:
            self.run.define_metric(pattern, step_metric="step")
        self._ledger_path = self.run_dir / EVAL_LEDGER
        self._logged: list[str] = self._read_ledger()

    # ------------------------------------------------------------------ training
    def log_update(self, row: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in row.items() if is_scalar(v)}, step=int(row.get("global_update", 0)))

    def log_rollouts(self, rows: list[dict], step: int, global_update: int) -> None:
        """This step's logged rollouts as a table (key `rollouts/samples`), at the step's last update."""
        if not rows:
            return
        import wandb

        table = wandb.Table(columns=list(ROLLOUT_COLUMNS),
                            data=[[table_cell(r.get(c)) for c in ROLLOUT_COLUMNS] for r in rows])
        self.run.log({"step": step, "rollouts/samples": table}, step=global_update)

    # ------------------------------------------------------------------ evals
    def sync_evals(self, eval_dir: Path, eval_name: str, questions: dict[int, str] | None = None) -> list[str]:
        """Log every finished eval in eval_dir (summary written) not logged yet, in step order.

        The initial-weights eval (`<name>_start`), the periodic ones (`<name>_step<k>`) and the final
        one (`<name>`); the final one also as a per-item table (`eval/items`). Returns the keys logged."""
        found = []
        for summary_path in Path(eval_dir).glob(f"{eval_name}*.summary.json"):
            stem = summary_path.name[:-len(".summary.json")]
            key = _eval_key(stem, eval_name)
            if key is None or key in self._logged:
                continue
            try:
                summary = json.loads(summary_path.read_text())
            except (OSError, ValueError) as e:
                log.warning("wandb: %s unreadable (%s); not logged", summary_path, e)
                continue
            step = 0 if key == "start" else int(summary.get("step", 0))
            found.append((step, key != "final", key, summary, summary_path.with_name(stem + ".jsonl")))
        done = []
        # the final eval sorts after a periodic one of the same step (there is none: periodic evals skip
        # the last step), and the start eval before any
        for step, _, key, summary, records_path in sorted(found, key=lambda t: (t[0], not t[1])):
            row: dict[str, Any] = {"step": step}
            for k in ("accuracy", "wilson_low", "wilson_high", "n"):
                if is_scalar(summary.get(k)):
                    row[f"eval/{k}"] = summary[k]
            if key == "final":
                row["eval/items"] = self._items_table(records_path, eval_dir / f"{eval_name}_start.jsonl",
                                                      questions)
            self.run.log(row, step=step * self.updates_per_batch)
            self._logged.append(key)
            atomic_write_json(self._ledger_path, {"evals": self._logged})
            done.append(key)
            if key == "start":
                self.run.summary["eval/start_accuracy"] = summary.get("accuracy")
            elif key == "final":
                for k in ("accuracy", "wilson_low", "wilson_high", "n"):
                    self.run.summary[f"eval/final_{k}"] = summary.get(k)
        return done

    def _items_table(self, records_path: Path, start_path: Path, questions: dict[int, str] | None) -> Any:
        import wandb

        from eval.records import read_item_records

        start = {}
        if start_path.is_file():
            start = {r["index"]: r["correct"] for r in read_item_records(start_path)}
        rows = []
        for r in read_item_records(records_path):
            full = {**r, "prompt": (questions or {}).get(r["index"]), "correct_at_start": start.get(r["index"])}
            rows.append([table_cell(full.get(c)) for c in EVAL_COLUMNS])
        return wandb.Table(columns=list(EVAL_COLUMNS), data=rows)

    def set_paired_result(self, paired: dict[str, Any]) -> None:
        """The final eval against the initial weights, item by item, into the summary (`eval_vs_start/*`)."""
        for k, v in paired.items():
            if is_scalar(v) or isinstance(v, str):
                self.run.summary[f"eval_vs_start/{k}"] = v

    def finish(self, exit_code: int | None = None) -> None:
        self.run.finish(exit_code=exit_code)

    def _read_ledger(self) -> list[str]:
        if not self._ledger_path.is_file():
            return []
        try:
            return list(json.loads(self._ledger_path.read_text()).get("evals", []))
        except (OSError, ValueError, AttributeError):
            log.warning("%s unreadable: evals already in wandb may be logged again", self._ledger_path)
            return []


def _eval_key(stem: str, eval_name: str) -> str | None:
    if stem == eval_name:
        return "final"
    if stem == f"{eval_name}_start":
        return "start"
    m = re.fullmatch(re.escape(eval_name) + r"_step(\d+)", stem)
    return f"step{int(m.group(1))}" if m else None


def is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float))


def table_cell(v: Any) -> Any:
    """A table cell: wandb tables take scalars and strings; anything else is shown as JSON."""
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return json.dumps(v)
