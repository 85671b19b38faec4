"""A dose-response over comparisons: each treatment's gap against the baseline at each level of one knob,
beside the mismatch the runs measured at that level.

    python -m eval.ladder COMPARE [COMPARE ...] [--knob backend.sampler_logit_noise] [--out DIR]

Each COMPARE is an `eval.compare` output folder (or its compare.json): one level of the knob, decided by
its own pre-registered rule. The knob is the one config key whose value differs between the levels'
baseline runs (or `--knob`); the levels must otherwise share the experiment, the arms and the rule's
endpoint. Per level it reads, from the compared runs themselves:

- the measured train-inference mismatch: `mismatch/abs_p_q90` at each batch's first update (the sampler's
  probabilities against the trainer's on the same tokens before any optimizer step of that batch), averaged
  over the batches of a run, then over the level's runs; and the same at the first batch alone (step 0:
  the knob's own mismatch, before training moved anything);
- GRPO's clip fraction and DPPO's masked fraction at those updates, as each arm's own rule or counted on
  the same tokens (the `loss/*` diagnostics every loss logs);
- each treatment's estimate, interval, verdict and level of that comparison's rule (compare.json).

Writes `ladder.json`, `ladder.md` and `ladder.png` (gap against measured mismatch, one line per treatment,
each point with its interval at its rule's level) into `--out` (default: beside the first comparison,
`ladder/`). The levels' intervals are those each comparison decided with: a family-wise statement across
levels needs each level's alpha split beforehand (the mismatch ladder's plan does: alpha 0.0125 per level).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eval.plots import finish_figure, load_metrics, new_figure
from eval.runs import config_differences, flatten
from eval.sequential import SETTING_IGNORED_KEYS
from trainer.config.ignored_keys import IGNORED_CONFIG_KEYS
from trainer.utils.io import atomic_write_json, atomic_write_text

MISMATCH_KEY = "mismatch/abs_p_q90"
# the diagnostics read at each batch's first update (every loss logs both, its own or counterfactual)
RULE_KEYS = {"grpo_clip_frac": "loss/grpo_clip_frac", "dppo_masked_frac": "loss/dppo_masked_frac",
             "ratio_max": "ratio/max"}
# keys that differ between levels without being a level: those the looks ledger leaves out of a setting
_NOT_A_KNOB = (*IGNORED_CONFIG_KEYS, *SETTING_IGNORED_KEYS)


class LadderError(ValueError):
    """Bad input: a one-line message, exit code 2."""


@dataclass
class Gap:
    treatment: str
    estimate: float
    ci_low: float | None
    ci_high: float | None
    verdict: str
    method: str
    level: float | None  # the alpha the interval was read at (Holm's, or the look's)


@dataclass
class Level:
    knob_value: Any
    compare: str
    n_seeds: int
    n_runs: int
    mismatch_q90: float | None  # mean over runs of the per-run mean at first updates
    mismatch_q90_step0: float | None
    rules: dict[str, float | None] = field(default_factory=dict)
    gaps: list[Gap] = field(default_factory=list)


def _compare_json(arg: str) -> Path:
    p = Path(arg)
    f = p / "compare.json" if p.is_dir() else p
    if not f.is_file():
        raise LadderError(f"{arg}: no compare.json there; give the folder eval.compare wrote (its output "
                          "dir)")
    return f


def _read(f: Path) -> dict[str, Any]:
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LadderError(f"{f}: not a readable compare.json ({e})") from None
    if not isinstance(d, dict) or d.get("mode") != "ab" or not isinstance(d.get("arms"), list):
        raise LadderError(f"{f}: not an A/B comparison (an --aa or --items output has no arms to read)")
    return d


def _run_config(run: Path) -> dict[str, Any]:
    f = run / "config.yaml"
    try:
        cfg = yaml.safe_load(f.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise LadderError(f"{f}: the run's config cannot be read ({e})") from None
    if not isinstance(cfg, dict):
        raise LadderError(f"{f}: the run's config is not a mapping")
    return cfg


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def first_update_means(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per run: the mean over batches of each key at the batch's first update, and the mismatch at step 0."""
    first = [r for r in rows if r.get("update") == 0]
    out = {"mismatch_q90": _mean([r.get(MISMATCH_KEY) for r in first]),
           "mismatch_q90_step0": _mean([r.get(MISMATCH_KEY) for r in first if r.get("step") == 0])}
    out.update({name: _mean([r.get(key) for r in first]) for name, key in RULE_KEYS.items()})
    return out


def read_level(f: Path, d: dict[str, Any]) -> tuple[Level, dict[str, Any]]:
    """One comparison as a level (knob_value filled in by the caller once the knob is known), and its
    baseline run's config."""
    per_run, base_cfg = [], None
    for arm in d["arms"]:
        run = Path(str(arm.get("run", "")))
        rows, _ = load_metrics(run / "metrics.jsonl")
        if not rows:
            raise LadderError(f"{f}: run {arm.get('arm')} has no metrics.jsonl at {run} (moved or deleted?)")
        per_run.append(first_update_means(rows))
        if arm.get("role") == "baseline" and base_cfg is None:
            base_cfg = _run_config(run)
    if base_cfg is None:
        raise LadderError(f"{f}: no baseline run among the arms")
    gaps = [Gap(treatment=v["treatment"], estimate=float(v["estimate"]), ci_low=v.get("ci_low"),
                ci_high=v.get("ci_high"), verdict=v["verdict"], method=v.get("method", ""),
                level=v.get("holm_level")) for v in d.get("verdicts", [])]
    level = Level(knob_value=None, compare=str(f.parent),
                  n_seeds=int(d.get("n_seeds", 0)), n_runs=len(per_run),
                  mismatch_q90=_mean([r["mismatch_q90"] for r in per_run]),
                  mismatch_q90_step0=_mean([r["mismatch_q90_step0"] for r in per_run]),
                  rules={name: _mean([r[name] for r in per_run]) for name in RULE_KEYS}, gaps=gaps)
    return level, base_cfg


def find_knob(configs: list[dict[str, Any]]) -> str:
    keys = sorted({k for c in configs[1:] for k, _, _ in config_differences(configs[0], c, _NOT_A_KNOB)})
    if len(keys) != 1:
        what = f"they differ in {keys}" if keys else "their baseline runs have the same config"
        raise LadderError(f"the levels need exactly one config key that differs between them, but {what}; "
                          "name it with --knob")
    return keys[0]


def build(paths: list[str], knob: str | None = None) -> tuple[str, list[Level]]:
    if len(paths) < 2:
        raise LadderError("give at least two comparisons (one per level of the knob)")
    files = [_compare_json(p) for p in paths]
    data = [_read(f) for f in files]
    same = {(d.get("baseline"), tuple(sorted(d.get("treatments") or [])),
             (d.get("decision") or {}).get("endpoint")) for d in data}
    if len(same) != 1:
        raise LadderError("the comparisons do not share their baseline, treatments and endpoint: "
                          f"{sorted(same, key=str)}")
    read = [read_level(f, d) for f, d in zip(files, data, strict=True)]
    knob = knob or find_knob([cfg for _, cfg in read])
    levels = []
    for level, cfg in read:
        flat = flatten(cfg)
        if knob not in flat:
            raise LadderError(f"{level.compare}: the baseline run's config has no key {knob!r}")
        level.knob_value = flat[knob]
        levels.append(level)
    values = [lv.knob_value for lv in levels]
    if len(set(map(str, values))) != len(values):
        raise LadderError(f"two comparisons are at the same level of {knob}: {values}")
    levels.sort(key=lambda lv: (lv.mismatch_q90 is None, lv.mismatch_q90 or 0.0))
    return knob, levels


def _pts(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}"


def render_md(knob: str, levels: list[Level]) -> str:
    lines = [f"# Dose-response over `{knob}`", "",
             "Each level is its own comparison, decided by its own rule; the interval is at that rule's "
             "level. Mismatch: `mismatch/abs_p_q90` at each batch's first update (mean over batches and "
             "runs), and at step 0 alone. Rule fractions at the same updates, over all arms (own rule or "
             "counterfactual).", "",
             f"| {knob} | mismatch q90 (step 0) | GRPO clip | DPPO mask | ratio max | treatment | gap, pts "
             "[interval] | verdict | seeds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        for i, g in enumerate(lv.gaps):
            head = (f"| {lv.knob_value} | {_f(lv.mismatch_q90)} ({_f(lv.mismatch_q90_step0)}) | "
                    f"{_f(lv.rules.get('grpo_clip_frac'))} | {_f(lv.rules.get('dppo_masked_frac'))} | "
                    f"{_f(lv.rules.get('ratio_max'), 2)} ") if i == 0 else "| | | | | "
            lines.append(f"{head}| {g.treatment} | {_pts(g.estimate)} [{_pts(g.ci_low)}, "
                         f"{_pts(g.ci_high)}] | {g.verdict} | {lv.n_seeds} |")
    lines += ["", "Comparisons: " + ", ".join(f"`{lv.compare}`" for lv in levels), ""]
    return "\n".join(lines)


def _f(x: float | None, digits: int = 4) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def plot(knob: str, levels: list[Level], path: Path) -> str:
    fig, ax = new_figure(f"Gap vs measured mismatch ({knob})",
                         "measured mismatch: |p - p_sampler| q90 at a batch's first update",
                         "treatment - baseline, points")
    treatments = sorted({g.treatment for lv in levels for g in lv.gaps})
    for k, t in enumerate(treatments):
        xs, ys, lo, hi = [], [], [], []
        for lv in levels:
            g = next((g for g in lv.gaps if g.treatment == t), None)
            if g is None or lv.mismatch_q90 is None:
                continue
            xs.append(lv.mismatch_q90 * (1 + 0.03 * (k - (len(treatments) - 1) / 2)))  # side by side
            ys.append(100 * g.estimate)
            lo.append(100 * (g.estimate - g.ci_low) if g.ci_low is not None else 0.0)
            hi.append(100 * (g.ci_high - g.estimate) if g.ci_high is not None else 0.0)
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=4, label=t)
    ax.axhline(0.0, color="grey", linewidth=1)
    ax.set_xscale("log")
    return finish_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.ladder", description=__doc__.split("\n\n")[0])
    p.add_argument("compares", nargs="+",
                   help="eval.compare output folders (or their compare.json), one per level")
    p.add_argument("--knob", default=None,
                   help="the config key that sets the level (default: the one that differs)")
    p.add_argument("--out", default=None, help="output folder (default: ladder/ beside the first comparison)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    try:
        knob, levels = build(args.compares, args.knob)
    except LadderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(levels[0].compare).parent / "ladder"
    out.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        plot(knob, levels, out / "ladder.png")
    atomic_write_text(out / "ladder.md", render_md(knob, levels))
    atomic_write_json(out / "ladder.json", {"knob": knob, "levels": [asdict(lv) for lv in levels]})
    print(render_md(knob, levels))
    plotted = "" if args.no_plot else f", {out / 'ladder.png'}"
    print(f"wrote {out / 'ladder.md'}, {out / 'ladder.json'}{plotted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
