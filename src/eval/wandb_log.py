"""The paired comparison in wandb: a run of `job_type=compare` in the arms' group.

`python -m eval.compare` calls `log_compare(result)` after writing compare.json when the arms logged to
wandb (their config.yaml has `logger.name: wandb`); `--no-wandb` opts out. The run holds the verdict
table (one row per seed plus the combined row, each with the verdict's scope), the arms table, each
treatment's headline (verdict and scope), the statistics in its summary and the
comparison's plots as images, so a dashboard grouped by the sweep shows the arms' curves and the
verdict side by side. It reads only compare's result dict and the arms' config.yaml, so it follows
whatever statistics compare reports: every scalar of the result goes to the summary.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from trainer.wandb_run import init_redacted, is_scalar, resolve_mode, run_id, table_cell

log = logging.getLogger(__name__)

JOB_TYPE = "compare"


def arms_wandb_settings(result: dict[str, Any]) -> dict[str, Any] | None:
    """(project, entity, group, mode) the arms logged under, or None if no arm logged to wandb.

    The group is the arms' `logger.group`, else their sweep folder's name (the trainer's default);
    arms of one comparison that disagree are reported and the first arm's settings are used."""
    found = []
    for arm in result.get("arms", []):
        run = Path(arm["run"])
        try:
            written = yaml.safe_load((run / "config.yaml").read_text()) or {}  # the arm's record, as written
        except (OSError, yaml.YAMLError):
            continue
        lc = written.get("logger") or {}
        if lc.get("name") != "wandb":
            continue
        group = lc.get("group") or (run.parent.name if (run.parent / "arms.json").is_file() else None)
        found.append({"project": lc.get("project", "pairedrl"), "entity": lc.get("entity"), "group": group,
                      "mode": lc.get("mode", "auto")})
    if not found:
        return None
    if any(f != found[0] for f in found[1:]):
        log.warning("the arms logged to different wandb projects/groups %s; the compare run goes to %s",
                    found, found[0])
    return found[0]


# the verdict's columns even where a row has none (one seed pair under a seed-level rule has no verdict)
_ALWAYS = ("verdict", "method", "verdict_scope", "verdict_about")


def verdict_rows(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """The verdict table: one row per seed, then the combined result; columns are the scalars they have."""
    per_seed = list(result.get("per_seed", []))
    scopes = [(f"seed {s.get('seed')}", s) for s in per_seed] + [("combined", result)]
    if len(result.get("comparisons") or []) > 1:  # several treatments: one row each (Holm-adjusted verdicts)
        per_seed = list(result["comparisons"])
        scopes = [(f"{c.get('treatment')} vs {c.get('baseline')}", c) for c in per_seed]
    cols: list[str] = []
    # the per-seed rows' statistics (the combined result also holds run-level strings: paths, the rule)
    for r in per_seed or [result]:
        cols += [k for k, v in r.items() if (is_scalar(v) or k in _ALWAYS) and k not in cols]
    return ["scope", *cols], [[label, *[table_cell(r.get(c)) for c in cols]] for label, r in scopes]


def log_compare(result: dict[str, Any], out_dir: str | Path | None = None) -> str | None:
    """Log the comparison to wandb if the arms did; returns the wandb run's folder, None if nothing logged."""
    settings = arms_wandb_settings(result)
    if settings is None:
        return None
    import wandb


    out_dir = Path(out_dir or result["output_dir"])
    t = result.get("treatment") or "+".join(result.get("treatments") or []) or "aa"
    b = result.get("baseline")
    config = {k: v for k, v in result.items() if is_scalar(v) or isinstance(v, str)}
    config.update(arms=[a.get("arm") for a in result.get("arms", [])], inputs=result.get("inputs"))
    run = init_redacted(project=settings["project"], entity=settings["entity"], group=settings["group"],
                        job_type=JOB_TYPE, name=f"compare_{t}_vs_{b}", dir=str(out_dir),
                        # one compare run per output folder: a rerun updates it rather than adding another
                        id=run_id(out_dir, "compare"),
                        resume="allow", mode=resolve_mode(settings["mode"]), config=config, reinit="create_new")
    try:
        cols, rows = verdict_rows(result)
        data: dict[str, Any] = {"compare/verdict": wandb.Table(columns=cols, data=rows)}
        arms = result.get("arms", [])
        if arms:
            acols: list[str] = []
            for a in arms:
                acols += [k for k, v in a.items() if (is_scalar(v) or isinstance(v, str)) and k not in acols]
            data["compare/arms"] = wandb.Table(columns=acols, data=[[table_cell(a.get(c)) for c in acols]
                                                                    for a in arms])
        for name, rel in (result.get("plots") or {}).items():
            path = out_dir / rel
            if path.is_file():
                data[f"compare/plots/{name}"] = wandb.Image(str(path), caption=name)
        run.log(data)
        for k, v in result.items():
            if is_scalar(v) or isinstance(v, str):
                run.summary[f"compare/{k}"] = v
        # each treatment's verdict with its scope ("these checkpoints" / "this training procedure")
        for v in result.get("verdicts") or []:
            run.summary[f"compare/headline/{v['treatment']}"] = v["headline"]
            run.summary[f"compare/verdict_scope/{v['treatment']}"] = v["verdict_scope"]
        folder = run.dir
    finally:
        run.finish()
    return str(Path(folder).parent)
