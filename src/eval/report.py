"""compare.md: the human-readable report of a paired comparison (rendered from compare.json's dict)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eval.stats import DECISION_RULE

_VERDICT_TEXT = {
    "validated": "the treatment is better: the lower bound of the paired CI is above 0",
    "inconclusive": "the treatment scored higher, but the lower bound of the paired CI is not above 0",
    "not_supported": "the treatment did not score higher than the baseline",
}
_PLOT_TITLES = {
    "reward": "Training reward (env/reward_mean) per rollout step",
    "masked_frac": "DPPO masked fraction (loss/dppo_masked_frac) per update",
    "clip_frac": "GRPO clip fraction (loss/grpo_clip_frac) per update",
    "drift_q90": "Drift |p - p_sampler| q90 (drift/abs_p_q90) per update",
    "accuracy": "Eval accuracy per arm with Wilson intervals",
}


def render_markdown(result: dict[str, Any], out_dir: str | Path) -> str:
    """Markdown for `result` (the compare.json dict); plot links are relative to out_dir."""
    out_dir = Path(out_dir)
    t, b = result["treatment"], result["baseline"]
    alpha = result["alpha"]
    conf = 100.0 * (1.0 - alpha)
    n = result["n"]
    lines = [
        f"# Paired comparison: {t} (treatment) vs {b} (baseline)",
        "",
        (f"Eval: `{result['eval_name']}`, {result['n_items']} items x {result['n_seeds']} seed(s) "
         f"= {n} paired (seed, item) results."),
        "",
        f"## Verdict: **{result['verdict']}**",
        "",
        (f"{_VERDICT_TEXT[result['verdict']]}: diff = {_pts(result['diff'])} "
         f"({conf:g}% Hoeffding CI [{_pts(result['ci_low'])}, {_pts(result['ci_high'])}])."),
        "",
        "## Decision rule (pre-registered)",
        "",
        "> " + DECISION_RULE.format(conf=conf),
        "",
        (f"At n = {result['n_items']} items and alpha = {alpha:g} the half-width is "
         f"{result['half_width']:.4f}, so "
         f"`validated` needs a gap above {_pts(result['half_width'])}. McNemar's exact test and the "
         "paired bootstrap are reported alongside; they do not change the verdict."),
        "",
        "## Results",
        "",
        "| scope | n | acc " + t + " | acc " + b + " | diff | Hoeffding CI | verdict | b | c "
        "| McNemar p | bootstrap CI |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|",
    ]
    rows = [(f"seed {s['seed']}", s) for s in result["per_seed"]]
    if len(rows) != 1:
        rows.append(("**combined**", result))
    else:
        rows = [(f"seed {result['per_seed'][0]['seed']}", result)]
    for label, r in rows:
        boot = ("-" if r.get("bootstrap_low") is None
                else f"[{_pts(r['bootstrap_low'])}, {_pts(r['bootstrap_high'])}]")
        lines.append(
            f"| {label} | {r['n']} | {r['acc_treatment']:.4f} | {r['acc_baseline']:.4f} | {_pts(r['diff'])} "
            f"| [{_pts(r['ci_low'])}, {_pts(r['ci_high'])}] | {r['verdict']} "
            f"| {r['b_items']} | {r['c_items']} "
            f"| {_p(r['mcnemar_p'])} | {boot} |")
    lines += [
        "",
        ("b = items the treatment got right and the baseline wrong; c = the reverse. "
         f"Bootstrap: {result['bootstrap_resamples']} percentile resamples of items (seed "
         f"{result['bootstrap_seed']})."),
    ]
    if result["n_seeds"] > 1:
        lines += ["", ("The combined row averages each item over its seeds, because one item's results "
                       "across seeds are correlated: n counts (seed, item) results and sets the "
                       f"accuracies, while the Hoeffding CI uses the {result['n_items']} items as the "
                       "independent unit, b / c count items whose seed-mean difference is positive / "
                       "negative (McNemar's exact test over items), and the bootstrap resamples whole "
                       f"items. Discordant (seed, item) pairs: {result['b']} / {result['c']}. The per-seed "
                       "rows are descriptive; only the combined verdict is pre-registered.")]
    lines += ["", "## Arms", "", f"| arm | role | seed | n | accuracy | Wilson {conf:g}% CI | run |",
              "|---|---|---:|---:|---:|---|---|"]
    for a in result["arms"]:
        lines.append(f"| {a['arm']} | {a['role']} | {a['seed']} | {a['n']} | {a['accuracy']:.4f} "
                     f"| [{a['wilson_low']:.4f}, {a['wilson_high']:.4f}] | `{a['run']}` |")
    if result.get("plots"):
        lines += ["", "## Plots", ""]
        for name, rel in result["plots"].items():
            lines += [f"### {_PLOT_TITLES.get(name, name)}", "", f"![{name}]({rel})", ""]
    notes = list(result.get("notes", []))
    if result.get("config_diff"):
        notes.insert(0, "configs differ outside the `loss` group (allowed by --allow-config-diff): "
                     + "; ".join(result["config_diff"]))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {x}" for x in notes]
    ignored = ", ".join(f"`{k}`" for k in result["ignored_config_keys"])
    lines += ["", "## Inputs", "", f"- ignored config keys: {ignored}",
              f"- item set sha256: `{result['item_set_sha256']}`"]
    lines += [f"- {a['arm']}: `{a['eval_file']}`" for a in result["arms"]]
    return "\n".join(lines).rstrip() + "\n"


def _pts(x: float) -> str:
    """A difference as signed percentage points."""
    return f"{100.0 * x:+.2f} pts"


def _p(p: float) -> str:
    if p == 0 or (p < 1e-4 and not math.isnan(p)):
        return f"{p:.2e}"
    return f"{p:.4f}"


if __name__ == "__main__":
    # `python -m eval.report <run folder>`: the single-run report (eval/run_report.py); this module's
    # own job is compare.md, written by `python -m eval.compare`
    import sys

    from eval.run_report import main

    sys.exit(main())
