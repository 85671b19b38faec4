"""The report of one training run: `report.md` and `report_plots/*.png` in the run folder.

`python -m eval.report <run folder>` (or `python -m eval.run_report`) writes it from the files the run
left (metrics.jsonl, eval/*.summary.json, result.json, run_info.json); train.py writes it at the end
of every run unless `report.enabled=false`. A plot whose metric the run did not log (e.g. the masked
fraction of a run stopped before its first update) is skipped with a note, never an error.
(eval/report.py renders the paired comparison's compare.md; this module is the single-run report.)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from eval.plots import (
    CLIP_KEY,
    DRIFT_KEY,
    MASKED_KEY,
    REWARD_KEY,
    finish_figure,
    load_metrics,
    new_figure,
    per_update,
    reward_by_step,
)

REPORT_FILE = "report.md"
PLOTS_DIR = "report_plots"
DRIFT_QUANTILES = (("drift/abs_p_q50", "q50"), ("drift/abs_p_q90", "q90"), ("drift/abs_p_q99", "q99"),
                   ("drift/abs_p_max", "max"))
TIME_PARTS = (("time/sample", "sampling"), ("time/train", "forward-backward + optim"))


class ReportError(ValueError):
    """The folder is not a run folder the report can be made from."""


def eval_points(run_dir: Path, eval_name: str | None) -> list[dict[str, Any]]:
    """Every finished eval of the run in step order: the initial weights (`<name>_start`), the periodic
    ones (`<name>_step<k>`) and the final one (`<name>`), each its summary plus `kind`."""
    eval_dir = run_dir / "eval"
    if not eval_dir.is_dir() or not eval_name:
        return []
    out = []
    for path in eval_dir.glob(f"{eval_name}*.summary.json"):
        stem = path.name[:-len(".summary.json")]
        if stem == eval_name:
            kind = "final"
        elif stem == f"{eval_name}_start":
            kind = "start"
        elif re.fullmatch(re.escape(eval_name) + r"_step\d+", stem):
            kind = "periodic"
        else:
            continue
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(s.get("accuracy"), (int, float)):
            continue
        step = 0 if kind == "start" else int(s.get("step", 0))
        out.append({**s, "kind": kind, "step": step})
    order = {"start": 0, "periodic": 1, "final": 2}
    return sorted(out, key=lambda e: (e["step"], order[e["kind"]]))


def make_run_plots(rows: list[dict[str, Any]], evals: list[dict[str, Any]], out_dir: Path,
                   label: str) -> tuple[dict[str, str], list[str]]:
    """The run's PNGs into out_dir: {name: path}, and notes about plots skipped for lack of data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    notes: list[str] = []

    xs, ys = reward_by_step(rows, REWARD_KEY)
    if xs:
        fig, ax = new_figure(f"Training reward: {label}", "rollout step", "mean over the step's rollouts")
        ax.plot(xs, ys, marker="." if len(xs) <= 60 else None, color="tab:blue", label="reward")
        cx, cy = reward_by_step(rows, "env/correct_rate")
        if cx:
            ax.plot(cx, cy, marker="." if len(cx) <= 60 else None, color="tab:green", linestyle="--",
                    label="correct rate")
        files["reward"] = finish_figure(fig, out_dir / "reward.png")
    else:
        notes.append(f"reward plot skipped: metrics.jsonl has no '{REWARD_KEY}'")

    if evals:
        fig, ax = new_figure(f"Eval accuracy by step (greedy, Wilson 95% CI): {label}", "rollout step",
                             "accuracy")
        xs = [e["step"] for e in evals]
        acc = [e["accuracy"] for e in evals]
        lo = [a - e.get("wilson_low", a) for a, e in zip(acc, evals)]
        hi = [e.get("wilson_high", a) - a for a, e in zip(acc, evals)]
        ax.errorbar(xs, acc, yerr=[lo, hi], fmt="-o", capsize=5, color="tab:orange", label="eval accuracy")
        for e in evals:
            ax.annotate(f"{e['accuracy']:.3f}" + (" (start)" if e["kind"] == "start" else ""),
                        (e["step"], e["accuracy"]), textcoords="offset points", xytext=(6, 6), fontsize="small")
        ax.set_ylim(-0.02, 1.02)
        ax.margins(x=0.08)
        files["eval_accuracy"] = finish_figure(fig, out_dir / "eval_accuracy.png", legend=False)
    else:
        notes.append("eval accuracy plot skipped: the run has no finished eval")

    series = [(name, per_update(rows, key)) for key, name in DRIFT_QUANTILES]
    series = [(n, s) for n, s in series if s[0]]
    if series:
        fig, ax = new_figure(f"Policy drift |p - p_sampler| per token: {label}", "update (global index)",
                             "quantile over the update's tokens")
        for name, (x, y) in series:
            ax.plot(x, y, marker="." if len(x) <= 60 else None, label=name)
        if all(v > 0 for _, (_, y) in series for v in y):
            ax.set_yscale("log")
        files["drift"] = finish_figure(fig, out_dir / "drift.png")
    else:
        notes.append(f"drift plot skipped: metrics.jsonl has no '{DRIFT_KEY}'")

    series = [(name, per_update(rows, key)) for key, name in ((MASKED_KEY, "DPPO masked fraction"),
                                                                (CLIP_KEY, "GRPO clip fraction"))]
    series = [(n, s) for n, s in series if s[0]]
    if series:
        fig, ax = new_figure(f"Masked / clipped token fractions: {label}", "update (global index)",
                             "fraction of the update's tokens")
        # every run logs both losses' diagnostics; dashed on top so equal curves both stay visible
        for (name, (x, y)), color, style in zip(series, ("tab:orange", "tab:blue"), ("-", "--")):
            ax.plot(x, y, marker="." if len(x) <= 60 else None, color=color, linestyle=style, label=name)
        files["masked_clip"] = finish_figure(fig, out_dir / "masked_clip.png")
    else:
        notes.append(f"masked/clip plot skipped: metrics.jsonl has neither '{MASKED_KEY}' nor '{CLIP_KEY}'")

    xs, ys = reward_by_step(rows, "env/completion_len_mean")
    if xs:
        fig, ax = new_figure(f"Completion length: {label}", "rollout step", "mean tokens per completion")
        ax.plot(xs, ys, marker="." if len(xs) <= 60 else None, color="tab:blue", label="mean length")
        ax.set_ylim(bottom=0)
        tx, ty = reward_by_step(rows, "env/frac_truncated")
        if tx:
            ax2 = ax.twinx()
            ax2.plot(tx, ty, color="tab:red", linestyle="--", marker="." if len(tx) <= 60 else None,
                     label="truncated fraction (right)")
            ax2.set_ylabel("fraction cut at the token budget")
            ax2.set_ylim(-0.02, 1.02)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize="small")
        files["completion_length"] = finish_figure(fig, out_dir / "completion_length.png", legend=not tx)
    else:
        notes.append("completion length plot skipped: metrics.jsonl has no 'env/completion_len_mean'")

    steps, total = reward_by_step(rows, "time/step")
    if steps:
        fig, ax = new_figure(f"Step time breakdown: {label}", "rollout step", "seconds")
        parts, bottom = [], [0.0] * len(steps)
        for key, _ in TIME_PARTS:
            part = dict(zip(*reward_by_step(rows, key)))
            vals = [max(0.0, min(part.get(s, 0.0), t - b)) for s, t, b in zip(steps, total, bottom)]
            parts.append(vals)
            bottom = [b + v for b, v in zip(bottom, vals)]
        parts.append([max(0.0, t - b) for t, b in zip(total, bottom)])
        names = [n for _, n in TIME_PARTS] + ["other (sampler weights, datums)"]
        colors = ["tab:blue", "tab:orange", "tab:gray"]
        if len(steps) <= 60:  # bars while they can be told apart, a stacked area beyond
            bottom = [0.0] * len(steps)
            for vals, name, color in zip(parts, names, colors):
                ax.bar(steps, vals, bottom=bottom, width=0.8, label=name, color=color)
                bottom = [b + v for b, v in zip(bottom, vals)]
        else:
            ax.stackplot(steps, *parts, labels=names, colors=colors)
        files["step_time"] = finish_figure(fig, out_dir / "step_time.png")
    else:
        notes.append("step time plot skipped: metrics.jsonl has no 'time/step'")
    return files, notes


def render_run_markdown(run_dir: Path, info: dict, result: dict, evals: list[dict], rows: list[dict],
                        files: dict[str, str], notes: list[str]) -> str:
    label = info.get("arm") or run_dir.name
    steps_done = len({r["step"] for r in rows})
    lines = [f"# Run report: {label}", "", f"Run folder: `{run_dir}`", "", "| | |", "|---|---|"]
    for k, v in (("arm", info.get("arm")), ("loss", info.get("loss")), ("seed", info.get("seed")),
                 ("experiment", info.get("experiment")), ("model", result.get("served_model")),
                 ("rollout steps logged", steps_done), ("optimizer updates logged", len(rows)),
                 ("final checkpoint", result.get("checkpoint"))):
        if v is not None:
            lines.append(f"| {k} | `{v}` |" if k in ("final checkpoint", "model") else f"| {k} | {v} |")
    if not result:
        lines += ["", "The run has not finished (no result.json): the report covers what it logged so far."]
    if evals:
        lines += ["", "## Eval accuracy", "", "| eval | step | n | accuracy | Wilson 95% CI |",
                  "|---|---:|---:|---:|---|"]
        for e in evals:
            lines.append(f"| {e['kind']} | {e['step']} | {e.get('n', '-')} | {e['accuracy']:.4f} "
                         f"| [{e.get('wilson_low', math.nan):.4f}, {e.get('wilson_high', math.nan):.4f}] |")
    paired = result.get("eval_vs_start")
    if paired:
        lines += ["", "## Final eval vs the initial weights (same items, paired)", "",
                  f"{paired.get('n')} items: {paired.get('acc_baseline', math.nan):.4f} -> "
                  f"{paired.get('acc_treatment', math.nan):.4f}, diff {paired.get('diff', math.nan):+.4f}"
                  + (f", bootstrap 95% CI [{paired['bootstrap_low']:+.4f}, {paired['bootstrap_high']:+.4f}]"
                     if isinstance(paired.get("bootstrap_low"), (int, float)) else "")
                  + (f", McNemar p = {paired['mcnemar_p']:.3g}" if isinstance(paired.get("mcnemar_p"), (int, float))
                     else "")
                  + (f" (fixed {paired['b']}, broke {paired['c']})" if "b" in paired and "c" in paired else "")
                  + "."]
        if paired.get("verdict"):
            lines += ["", (f"Paired Hoeffding verdict: **{paired['verdict']}** (these checkpoints: the final weights "
                           "against the initial ones on these items; one run says nothing about the loss apart "
                           "from training noise).")]
    times = [(k, v) for k, v in result.items() if k.startswith("time/") and isinstance(v, (int, float))]
    if times:
        lines += ["", "## Wall time", "", "| phase | seconds |", "|---|---:|"]
        lines += [f"| {k[5:]} | {v:.1f} |" for k, v in times]
    titles = {"reward": "Training reward", "eval_accuracy": "Eval accuracy by step", "drift": "Drift quantiles",
              "masked_clip": "Masked / clipped fractions", "completion_length": "Completion length",
              "step_time": "Step time breakdown"}
    if files:
        lines += ["", "## Plots", ""]
        for name, path in files.items():
            lines += [f"### {titles.get(name, name)}", "", f"![{name}]({Path(path).relative_to(run_dir)})", ""]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


def write_run_report(run_dir: str | Path) -> Path:
    """Write report.md and report_plots/ into run_dir; returns report.md's path."""
    from trainer.utils.io import atomic_write_text

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder")
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "run_info.json").is_file():
        raise ReportError(f"{run_dir} is not a run folder: it has neither metrics.jsonl nor run_info.json")
    info = _read_json(run_dir / "run_info.json")
    result = _read_json(run_dir / "result.json")
    eval_name = _eval_name(run_dir, result)
    rows, notes = load_metrics(run_dir / "metrics.jsonl")
    evals = eval_points(run_dir, eval_name)
    files, plot_notes = make_run_plots(rows, evals, run_dir / PLOTS_DIR, info.get("arm") or run_dir.name)
    text = render_run_markdown(run_dir, info, result, evals, rows, files, notes + plot_notes)
    atomic_write_text(run_dir / REPORT_FILE, text)
    return run_dir / REPORT_FILE


def _eval_name(run_dir: Path, result: dict) -> str | None:
    name = (result.get("eval") or {}).get("name")
    if name:
        return name
    written = run_dir / "config.yaml"
    if written.is_file():
        import yaml

        try:
            return ((yaml.safe_load(written.read_text()) or {}).get("eval") or {}).get("name")
        except yaml.YAMLError:
            return None
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path} is unreadable ({e})") from None
    return d if isinstance(d, dict) else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.report",
                                description="Write report.md and report_plots/*.png for one training run.")
    p.add_argument("run", help="a run folder (the one train.py printed as 'run folder')")
    args = p.parse_args(argv)
    try:
        path = write_run_report(args.run)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
