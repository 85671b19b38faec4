"""PNG plots of a paired comparison (matplotlib, Agg backend; no display needed).

Each plot is made from whichever runs have its metric key; a plot whose key no run has is
skipped with a note (returned to the caller for the report), never an exception.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REWARD_KEY = "env/reward_mean"
MASKED_KEY = "loss/dppo_masked_frac"
CLIP_KEY = "loss/grpo_clip_frac"
DRIFT_KEY = "drift/abs_p_q90"

# (file stem, metric key, y label, title); x = global update index
PER_UPDATE_PLOTS = (
    ("masked_frac", MASKED_KEY, "masked token fraction", "DPPO masked fraction per update"),
    ("clip_frac", CLIP_KEY, "clipped token fraction", "GRPO clip fraction per update"),
    ("drift_q90", DRIFT_KEY, "|p - p_sampler| q90", "Policy drift (q90) per update"),
)
_STYLES = ("-", "--", ":", "-.")


@dataclass
class PlotRun:
    """One run as the plots need it."""

    label: str  # arm name, e.g. dppo_seed0
    role: str  # "treatment" | "baseline"
    seed: int
    metrics: list[dict[str, Any]] = field(default_factory=list)
    accuracy: float | None = None
    wilson_low: float | None = None
    wilson_high: float | None = None


def load_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of metrics.jsonl, ordered by (step, update), one row per (step, update).

    A resumed run may log a (step, update) twice: the last row wins. Unparsable lines (e.g. a
    torn last line of a killed run) and rows without `step` are skipped and reported in notes."""
    path = Path(path)
    if not path.is_file():
        return [], [f"{path} not found: training-curve plots omit this run"]
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    bad, no_step = [], 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad.append(lineno)
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
                no_step += 1
                continue
            rows[(int(row["step"]), int(row.get("update", 0) or 0))] = row
    notes = []
    if bad:
        notes.append(f"{path}: skipped {len(bad)} unparsable line(s) (first: line {bad[0]})")
    if no_step:
        notes.append(f"{path}: skipped {no_step} row(s) without a numeric 'step'")
    return [rows[k] for k in sorted(rows)], notes


def reward_by_step(rows: list[dict[str, Any]], key: str = REWARD_KEY) -> tuple[list[int], list[float]]:
    """One value per rollout step: the first update's row of each step that has the key."""
    steps, values, seen = [], [], set()
    for row in rows:
        step = int(row["step"])
        if step in seen or not _is_number(row.get(key)):
            continue
        seen.add(step)
        steps.append(step)
        values.append(float(row[key]))
    return steps, values


def per_update(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(global update index, value) for the rows having the key; index = position in (step, update) order."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        if _is_number(row.get(key)):
            xs.append(i)
            ys.append(float(row[key]))
    return xs, ys


def make_plots(runs: list[PlotRun], out_dir: str | Path,
               title_suffix: str = "") -> tuple[dict[str, str], list[str]]:
    """Write the PNGs into out_dir; returns ({plot name: file path}, notes about skipped plots)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    notes: list[str] = []

    series = {r.label: reward_by_step(r.metrics) for r in runs}
    if _plot_lines(runs, series, "rollout step", "mean reward", f"Training reward{title_suffix}",
                   out_dir / "reward.png"):
        files["reward"] = str(out_dir / "reward.png")
        notes += _missing_note(runs, series, REWARD_KEY)
    else:
        notes.append(f"reward plot skipped: no run logged '{REWARD_KEY}' in metrics.jsonl")

    for stem, key, ylabel, title in PER_UPDATE_PLOTS:
        series = {r.label: per_update(r.metrics, key) for r in runs}
        path = out_dir / f"{stem}.png"
        if _plot_lines(runs, series, "update (global index)", ylabel, title + title_suffix, path):
            files[stem] = str(path)
            notes += _missing_note(runs, series, key)
        else:
            notes.append(f"{stem} plot skipped: no run logged '{key}' in metrics.jsonl")

    acc_runs = [r for r in runs if r.accuracy is not None]
    if acc_runs:
        path = out_dir / "accuracy.png"
        _plot_accuracy(acc_runs, f"Eval accuracy with Wilson intervals{title_suffix}", path)
        files["accuracy"] = str(path)
    else:
        notes.append("accuracy plot skipped: no run has an accuracy")
    return files, notes


def _plot_lines(runs: list[PlotRun], series: dict[str, tuple[list, list]], xlabel: str, ylabel: str,
                title: str, path: Path) -> bool:
    if not any(series[r.label][0] for r in runs):
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        seeds = sorted({r.seed for r in runs})
        for r in runs:
            xs, ys = series[r.label]
            if not xs:
                continue
            ax.plot(xs, ys, color=_color(r.role), linestyle=_STYLES[seeds.index(r.seed) % len(_STYLES)],
                    marker="." if len(xs) <= 60 else None, label=r.label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return True


def _plot_accuracy(runs: list[PlotRun], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(runs) + 2), 4))
    try:
        for i, r in enumerate(runs):
            lo = r.accuracy - (r.wilson_low if r.wilson_low is not None else r.accuracy)
            hi = (r.wilson_high if r.wilson_high is not None else r.accuracy) - r.accuracy
            ax.errorbar([i], [r.accuracy], yerr=[[lo], [hi]], fmt="o", capsize=6, color=_color(r.role))
            ax.annotate(f"{r.accuracy:.3f}", (i, r.accuracy), textcoords="offset points", xytext=(8, 0),
                        fontsize="small", va="center")
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels([r.label for r in runs], rotation=20)
        ax.set_xlim(-0.6, len(runs) - 0.4)
        ax.set_ylabel("accuracy")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)


def plot_eval_curve(curve: dict[str, Any], path: Path, title: str) -> str:
    """Accuracy vs eval step of each arm (mean over seeds) with its interval band (t over seeds, or Wilson
    for one seed), from compare's `curve` table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        steps = curve["steps"]
        palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
        for i, (loss, arm) in enumerate(curve["arms"].items()):
            color = palette[i % len(palette)]
            ax.plot(steps, arm["accuracy"], marker="o", color=color, label=f"{loss} ({arm['interval']})")
            ax.fill_between(steps, arm["low"], arm["high"], color=color, alpha=0.2)
        if curve.get("threshold") is not None:
            ax.axhline(curve["threshold"], color="grey", linestyle=":", label="threshold")
        ax.set_xlabel("rollout step")
        ax.set_ylabel("eval accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        _save(fig, path)
    finally:
        plt.close(fig)
    return str(path)


def _save(fig: Any, path: Path) -> None:
    """savefig via a temp file and os.replace: never a torn PNG."""
    from trainer.utils.io import atomic_replace

    atomic_replace(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), suffix=".png")


def _missing_note(runs: list[PlotRun], series: dict[str, tuple[list, list]], key: str) -> list[str]:
    missing = [r.label for r in runs if not series[r.label][0]]
    return [f"'{key}' missing for {', '.join(missing)}: omitted from its plot"] if missing else []


def _color(role: str) -> str:
    return "tab:orange" if role == "treatment" else "tab:blue"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


# ----------------------------------------------------------------------------- shared style
# The run report (eval/run_report.py) draws with these, so its figures look like the comparison's:
# the same size, resolution, grid and legend, saved the same way.
FIGSIZE = (7, 4)


def new_figure(title: str, xlabel: str, ylabel: str, figsize: tuple[float, float] = FIGSIZE) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=figsize)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    # steps and updates are counts: integer ticks only
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def finish_figure(fig: Any, path: Path, legend: bool = True) -> str:
    """Legend (when anything is labelled), tight layout, atomic save, close; returns the path."""
    try:
        for ax in fig.axes:
            if legend and ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
        fig.tight_layout()
        _save(fig, Path(path))
    finally:
        plt.close(fig)
    return str(path)
