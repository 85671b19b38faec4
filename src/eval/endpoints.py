"""Eval curves of a run and the endpoints compared on them: final accuracy, accuracy at a step, the
per-item area under the eval curve, and steps to a threshold.

A run's eval files (written by the trainer) are
  eval/<name>_start.jsonl    the initial weights (step 0; eval.at_start)
  eval/<name>_step<k>.jsonl  every eval.every rollout steps (0 < k < num_steps)
  eval/<name>.jsonl          the final weights (step = schedule.num_steps)
All of them must hold the same items as the final eval, so that every point of the curve is paired
item by item with the other arm's point at the same step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from eval.records import read_item_records


class EndpointError(ValueError):
    """An eval curve or endpoint cannot be built; the message names the run and file."""


def item_score(rec: dict[str, Any]) -> bool | float:
    """An item's score: its fraction correct over K samples (`score`, eval.samples_per_item > 1), else its
    greedy `correct`."""
    return float(rec["score"]) if rec.get("score") is not None else bool(rec["correct"])


def _scores(values: list[Any]) -> np.ndarray:
    """bool where every score is 0/1 (greedy correctness), else float64 scores in [0, 1]."""
    a = np.array(values, dtype=np.float64)
    return a.astype(np.bool_) if np.isin(a, (0.0, 1.0)).all() else a


def curve_files(eval_dir: Path, eval_name: str, final_step: int) -> dict[int, Path]:
    """{step: file} of one run's evals (start, periodic, final)."""
    files: dict[int, Path] = {}
    start = eval_dir / f"{eval_name}_start.jsonl"
    if start.is_file():
        files[0] = start
    pat = re.compile(rf"^{re.escape(eval_name)}_step(\d+)\.jsonl$")
    if eval_dir.is_dir():
        for p in eval_dir.iterdir():
            m = pat.match(p.name)
            if m and int(m.group(1)) < final_step:
                files[int(m.group(1))] = p
    final = eval_dir / f"{eval_name}.jsonl"
    if final.is_file():
        files[final_step] = final
    return dict(sorted(files.items()))


def load_curve(label: str, eval_dir: Path, eval_name: str, final_step: int,
               final_records: list[dict[str, Any]]) -> dict[int, dict[int, bool]]:
    """{step: {item index: correct}} of one run; every file must hold the final eval's items."""
    ref = {r["index"]: r["question_sha256"] for r in final_records}
    curve: dict[int, dict[int, bool]] = {}
    files: dict[int, Path | None] = dict(curve_files(eval_dir, eval_name, final_step))
    if final_records:  # records held in memory stand for the final eval file
        files[final_step] = files.get(final_step)
    for step, path in sorted(files.items()):
        recs = final_records if step == final_step else read_item_records(path)
        m = {r["index"]: r["question_sha256"] for r in recs}
        if m != ref:
            only_here = sorted(set(m) - set(ref))[:10]
            only_final = sorted(set(ref) - set(m))[:10]
            changed = sorted(i for i in set(m) & set(ref) if m[i] != ref[i])[:10]
            raise EndpointError(
                f"periodic evals on different item sets: run {label}: {path} ({len(m)} items) vs the final "
                f"eval ({len(ref)} items): indices only in the step-{step} eval {only_here}, only in the final "
                f"eval {only_final}, other questions at {changed}; every eval of a run must use the final "
                "eval's items for the curve to be paired")
        curve[step] = {r["index"]: item_score(r) for r in recs}
    return curve


def common_steps(curves: dict[str, dict[int, Any]]) -> tuple[list[int], list[str]]:
    """Steps every run evaluated, and a note per run that has other steps too."""
    sets = {k: set(c) for k, c in curves.items()}
    common = sorted(set.intersection(*sets.values())) if sets else []
    notes = [f"run {k} has eval steps {sorted(v - set(common))} that not every run has (left out of the curve)"
             for k, v in sets.items() if v - set(common)]
    return common, notes


def auc_scores(curve: dict[int, dict[int, bool]], steps: list[int], order: list[int]) -> np.ndarray:
    """Per-item normalised area under the correctness curve over `steps` (trapezoid rule), in [0, 1]:
    1 = right at every eval, 0 = never right; an item learned earlier scores higher."""
    if len(steps) < 2:
        raise EndpointError(f"the area under the eval curve needs >= 2 eval steps, got {steps} "
                            "(set eval.every, and eval.at_start for step 0)")
    c_KN = np.array([[curve[s][i] for i in order] for s in steps], dtype=np.float64)
    x_K = np.asarray(steps, dtype=np.float64)
    area_N = (np.diff(x_K)[:, None] * (c_KN[1:] + c_KN[:-1]) / 2.0).sum(axis=0)
    return area_N / (x_K[-1] - x_K[0])


def endpoint_scores(curve: dict[int, dict[int, bool]], endpoint: str, step: int | None, steps: list[int],
                    order: list[int], final_step: int, label: str) -> np.ndarray:
    """One run's per-item values of the endpoint, in item order."""
    if endpoint == "final":
        return _scores([curve[final_step][i] for i in order])
    if endpoint == "step":
        if step not in curve:
            raise EndpointError(f"endpoint=step needs an eval at step {step}, but run {label} has evals at "
                                f"steps {sorted(curve)} (eval.every, eval.at_start and schedule.num_steps "
                                "decide which steps are evaluated)")
        return _scores([curve[step][i] for i in order])
    if endpoint == "auc":
        return auc_scores(curve, steps, order)
    raise EndpointError(f"unknown endpoint {endpoint!r} (final | step | auc)")


def accuracy_by_step(curve: dict[int, dict[int, bool]], steps: list[int]) -> list[float]:
    return [float(np.mean(list(curve[s].values()))) for s in steps]


def steps_to_threshold(acc_K: list[float], steps: list[int], threshold: float) -> int | None:
    """First eval step at which the accuracy reaches `threshold` (None if it never does)."""
    for s, a in zip(steps, acc_K):
        if a >= threshold:
            return s
    return None
