"""`python -m eval.compare <sweep> | <run_a> <run_b>`: the paired verdict of two arms.

Finds the runs (numbered subfolders of a sweep, or two run folders), checks that they are one
paired experiment (same items, configs equal outside the `loss` group and the per-run keys in
IGNORED_CONFIG_KEYS), pairs treatment and baseline by seed and by item index, and writes
`compare.json`, `compare.md` and `compare_plots/*.png` into the output folder. compare.json is
also printed on stdout. Every check runs before anything is written, so a refused comparison
leaves an existing compare.json untouched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from eval.records import read_item_records, summarize
from eval.stats import DECISION_RULE, paired_compare
from trainer.utils.io import atomic_write_json, atomic_write_text

# Config keys (dotted prefixes) that may differ between the runs of one paired experiment:
IGNORED_CONFIG_KEYS: tuple[str, ...] = (
    "loss",               # the arm switch itself; each arm's loss group is checked across its seeds, and
                          # the keys both losses have (aggregation) across the arms
    "seed",               # pairs are matched by seed; different seeds are the replication
    "run_name",           # the arm label (derived from loss and seed)
    "resume",             # resuming continues the same computation
    "checkpoint",         # eval.run's input path
    "backend.state_dir",  # per-run output path of the engine's checkpoints
    "preflight.dir",      # where the preflight results were read from
    "logger",             # where metrics go (wandb project/group/run names, mode); no effect on training
    "report",             # whether the per-run report is written; no effect on training
    "hydra",              # Hydra's runtime section (output dirs, job names), if present
)
PLOTS_DIR = "compare_plots"


class CompareError(ValueError):
    """The inputs cannot be compared; the message names the run or file and the problem."""


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    info: dict[str, Any]
    loss: str
    seed: int
    eval_name: str
    job: str | None = None
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def arm(self) -> str:
        return f"{self.loss}_seed{self.seed}"

    @property
    def eval_file(self) -> Path:
        return self.path / "eval" / f"{self.eval_name}.jsonl"


# ----------------------------------------------------------------------------- discovery
def discover_runs(sweep: Path) -> list[tuple[str, Path]]:
    """(job number, folder) of each numbered subfolder, checked against arms.json when present."""
    if not sweep.is_dir():
        raise CompareError(f"sweep folder not found: {sweep}")
    jobs = sorted(((p.name, p) for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()),
                  key=lambda x: int(x[0]))
    arms_file = sweep / "arms.json"
    if arms_file.is_file():
        try:
            arms = json.loads(arms_file.read_text())
        except json.JSONDecodeError as e:
            raise CompareError(f"{arms_file} is not valid JSON (line {e.lineno}: {e.msg})") from None
        listed = (arms.keys() if isinstance(arms, dict) else
                  [str(i) for i in range(len(arms))] if isinstance(arms, list) else None)
        if listed is None:
            raise CompareError(f"{arms_file}: expected an object mapping job number -> arm name")
        present = {j for j, _ in jobs}
        missing = [str(j) for j in listed if str(j) not in present]
        if missing:
            names = [arms[j] if isinstance(arms, dict) else arms[int(j)] for j in missing]
            raise CompareError(f"{arms_file} lists job(s) {missing} ({names}) but their folders are missing "
                               f"from {sweep}: did those runs fail?")
    if not jobs:
        raise CompareError(f"no run folders (numbered subfolders) in {sweep}; pass a sweep folder "
                           "(multirun/<date>/<time>) or two run folders")
    return jobs


def load_run(path: Path, eval_name: str | None, job: str | None = None) -> Run:
    """Read config.yaml and run_info.json of one run (not its eval file yet)."""
    cfg_file, info_file = path / "config.yaml", path / "run_info.json"
    for f in (cfg_file, info_file):
        if not f.is_file():
            raise CompareError(f"run {path}: missing {f.name} (not a finished run folder?)")
    try:
        config = yaml.safe_load(cfg_file.read_text())
    except yaml.YAMLError as e:
        raise CompareError(f"run {path}: {cfg_file.name} is not valid YAML: {e}") from None
    try:
        info = json.loads(info_file.read_text())
    except json.JSONDecodeError as e:
        raise CompareError(f"run {path}: {info_file.name} is not valid JSON "
                           f"(line {e.lineno}: {e.msg})") from None
    loss_cfg = config.get("loss") if isinstance(config, dict) else None
    if not isinstance(loss_cfg, dict) or "name" not in loss_cfg:
        raise CompareError(f"run {path}: {cfg_file.name} has no `loss.name`")
    seed = config.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CompareError(f"run {path}: {cfg_file.name} has no integer top-level `seed` (got {seed!r})")
    loss = str(config["loss"]["name"])
    for key, want in (("loss", loss), ("seed", seed)):
        if key in info and info[key] != want:
            raise CompareError(f"run {path}: run_info.json says {key}={info[key]!r} but config.yaml says "
                               f"{want!r}")
    if eval_name is None:
        eval_name = (config.get("eval") or {}).get("name")
        if not eval_name or eval_name == "none":
            raise CompareError(f"run {path}: config has no eval (eval.name={eval_name!r}); pass --eval-name")
    return Run(path=path, config=config, info=info, loss=loss, seed=seed, eval_name=str(eval_name), job=job)


def load_records(run: Run) -> None:
    if not run.eval_file.is_file():
        eval_dir = run.path / "eval"
        have = sorted(p.name for p in eval_dir.glob("*.jsonl")) if eval_dir.is_dir() else []
        hint = f" (eval files present: {have})" if have else " (no eval/ files: did the run finish?)"
        raise CompareError(f"run {run.arm} ({run.path}): missing final eval file {run.eval_file}{hint}")
    run.records = read_item_records(run.eval_file)


# ----------------------------------------------------------------------------- checks
def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {dotted.key: leaf}; lists are leaves."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _ignored(key: str, ignore: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in ignore)


def config_differences(a: dict[str, Any], b: dict[str, Any],
                       ignore: tuple[str, ...] = IGNORED_CONFIG_KEYS) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for each dotted key that differs and is not ignored."""
    fa, fb = flatten(a), flatten(b)
    missing = object()
    diffs = []
    for key in sorted(set(fa) | set(fb)):
        if _ignored(key, ignore):
            continue
        va, vb = fa.get(key, missing), fb.get(key, missing)
        if va != vb:
            diffs.append((key, "<absent>" if va is missing else va, "<absent>" if vb is missing else vb))
    return diffs


def check_configs(runs: list[Run], roles: dict[str, str]) -> list[str]:
    """Differences outside the ignore list, and between the loss groups of one arm's seeds."""
    ref = runs[0]
    found: list[str] = []
    for r in runs[1:]:
        for key, va, vb in config_differences(ref.config, r.config):
            found.append(f"{key}: {va!r} ({ref.arm}, {ref.path}) vs {vb!r} ({r.arm}, {r.path})")
    for role in ("treatment", "baseline"):
        same = [r for r in runs if roles[r.loss] == role]
        for r in same[1:]:
            for key, va, vb in config_differences(same[0].config["loss"], r.config["loss"], ignore=()):
                found.append(f"loss.{key}: {va!r} ({same[0].arm}) vs {vb!r} ({r.arm}): the {role} arm's "
                             "loss differs between seeds")
    # keys both loss configs have, other than the loss's identity, are settings the arms must share (the
    # token aggregation also decides the one-pass vs two-pass path): only the loss function may differ
    t = next(r for r in runs if roles[r.loss] == "treatment")
    b = next(r for r in runs if roles[r.loss] == "baseline")
    shared = (set(t.config["loss"]) & set(b.config["loss"])) - {"name", "_target_"}
    for key, va, vb in config_differences({k: t.config["loss"][k] for k in shared},
                                          {k: b.config["loss"][k] for k in shared}, ignore=()):
        found.append(f"loss.{key}: {va!r} ({t.arm}) vs {vb!r} ({b.arm}): a setting both losses have differs "
                     "between the arms")
    return found


def check_item_sets(runs: list[Run]) -> str:
    """Raise unless all runs have the same (index, question_sha256) set; returns its sha256."""
    ref = runs[0]
    ref_map = {r["index"]: r["question_sha256"] for r in ref.records}
    for run in runs[1:]:
        m = {r["index"]: r["question_sha256"] for r in run.records}
        only_ref, only_run = sorted(set(ref_map) - set(m)), sorted(set(m) - set(ref_map))
        if only_ref or only_run:
            raise CompareError(
                f"item sets differ: {ref.arm} ({ref.eval_file}) has {len(ref_map)} items, {run.arm} "
                f"({run.eval_file}) has {len(m)}; indices only in {ref.arm}: {only_ref[:10]}"
                f"{'...' if len(only_ref) > 10 else ''}, only in {run.arm}: {only_run[:10]}"
                f"{'...' if len(only_run) > 10 else ''}")
        bad = sorted(i for i in ref_map if ref_map[i] != m[i])
        if bad:
            raise CompareError(
                f"item sets differ: question_sha256 of {len(bad)} item(s) differ between {ref.arm} "
                f"({ref.eval_file}) and {run.arm} ({run.eval_file}), e.g. indices {bad[:10]}: "
                "the runs did not evaluate the same questions")
    blob = "\n".join(f"{i}:{ref_map[i]}" for i in sorted(ref_map)).encode()
    return hashlib.sha256(blob).hexdigest()


def pair_by_seed(runs: list[Run], treatment: str, baseline: str) -> dict[int, tuple[Run, Run]]:
    """{seed: (treatment run, baseline run)}; exactly one run per (arm, seed)."""
    by_key: dict[tuple[str, int], Run] = {}
    for r in runs:
        if r.loss not in (treatment, baseline):
            raise CompareError(f"run {r.path} has loss '{r.loss}', neither the treatment '{treatment}' "
                               f"nor the baseline '{baseline}' (set --treatment/--baseline)")
        if (r.loss, r.seed) in by_key:
            raise CompareError(f"two runs of arm {r.arm}: {by_key[(r.loss, r.seed)].path} and {r.path}; "
                               "compare needs exactly one run per (loss, seed)")
        by_key[(r.loss, r.seed)] = r
    pairs = {}
    for seed in sorted({r.seed for r in runs}):
        t, b = by_key.get((treatment, seed)), by_key.get((baseline, seed))
        if t is None or b is None:
            have, lack = (t or b), (treatment if t is None else baseline)
            raise CompareError(f"seed {seed} has no '{lack}' run to pair with {have.arm} ({have.path})")
        pairs[seed] = (t, b)
    return pairs


def _correct_by_index(run: Run, order: list[int]) -> np.ndarray:
    m = {r["index"]: r["correct"] for r in run.records}
    return np.array([m[i] for i in order], dtype=np.bool_)


# ----------------------------------------------------------------------------- main entry
def compare(paths: list[str | Path], treatment: str = "dppo", baseline: str = "grpo", alpha: float = 0.05,
            eval_name: str | None = None, allow_config_diff: bool = False, n_bootstrap: int = 10000,
            seed: int = 0, out: str | Path | None = None, make_plots: bool = True,
            allow_mixed_loss_paths: bool = False) -> dict[str, Any]:
    """Run all checks, compute the statistics and write compare.json / compare.md / plots."""
    if treatment == baseline:
        raise CompareError(f"--treatment and --baseline are both '{treatment}'")
    if not 0 < alpha < 1:
        raise CompareError(f"--alpha must be in (0, 1), got {alpha}")
    if n_bootstrap < 0:
        raise CompareError(f"--bootstrap must be >= 0, got {n_bootstrap}")
    paths = [Path(p).resolve() for p in paths]
    if len(paths) == 1:
        if (paths[0] / "config.yaml").is_file():
            raise CompareError(f"{paths[0]} is a single run folder; pass its sweep folder or two run folders")
        runs = [load_run(p, eval_name, job) for job, p in discover_runs(paths[0])]
        out_dir = Path(out).resolve() if out else paths[0]
    elif len(paths) == 2:
        if paths[0] == paths[1]:
            raise CompareError(f"the two run folders are the same: {paths[0]}")
        runs = [load_run(p, eval_name) for p in paths]
        if runs[0].seed != runs[1].seed:
            raise CompareError(f"the two runs have different seeds ({runs[0].arm}: {runs[0].path}, "
                               f"{runs[1].arm}: {runs[1].path}); arms are paired within one seed")
        out_dir = Path(out).resolve() if out else Path(os.path.commonpath([str(p) for p in paths]))
    else:
        raise CompareError(f"expected one sweep folder or two run folders, got {len(paths)} paths")

    names = [runs[0].eval_name]
    if any(r.eval_name != names[0] for r in runs):
        raise CompareError("runs have different eval names: "
                           + ", ".join(f"{r.path.name}={r.eval_name}" for r in runs) + " (pass --eval-name)")
    pairs = pair_by_seed(runs, treatment, baseline)
    roles = {treatment: "treatment", baseline: "baseline"}
    ordered = [r for s in pairs for r in (pairs[s][1], pairs[s][0])]  # baseline first: the reference config
    config_diff = check_configs(ordered, roles)
    if config_diff and not allow_config_diff:
        shown = "\n  ".join(config_diff[:20]) + ("\n  ..." if len(config_diff) > 20 else "")
        raise CompareError("configs differ outside the `loss` group (a different experiment or setting?); "
                           f"pass --allow-config-diff to compare anyway:\n  {shown}")
    for r in ordered:
        load_records(r)
    item_sha = check_item_sets(ordered)
    order = sorted(r["index"] for r in ordered[0].records)

    correct_T_SN = np.stack([_correct_by_index(pairs[s][0], order) for s in pairs])
    correct_B_SN = np.stack([_correct_by_index(pairs[s][1], order) for s in pairs])
    result = paired_compare(correct_T_SN, correct_B_SN, alpha=alpha, n_bootstrap=n_bootstrap, seed=seed)
    per_seed = []
    for i, s in enumerate(pairs):
        r = paired_compare(correct_T_SN[i], correct_B_SN[i], alpha=alpha, n_bootstrap=n_bootstrap, seed=seed)
        r.update(seed=s, treatment_arm=pairs[s][0].arm, baseline_arm=pairs[s][1].arm)
        per_seed.append(r)
    arms = []
    for r in ordered:
        summ = summarize(r.records, alpha=alpha)
        arms.append({"arm": r.arm, "role": roles[r.loss], "loss": r.loss, "seed": r.seed, "run": str(r.path),
                     "job": r.job, "run_name": r.info.get("arm", r.config.get("run_name")),
                     "eval_file": str(r.eval_file), **summ})
    notes = _run_notes(ordered)
    mixed = _mixed_loss_paths(ordered)
    if mixed and not (allow_mixed_loss_paths or allow_config_diff):
        raise CompareError(f"the runs computed their loss on different paths {mixed} (backend.loss_path=auto fell "
                           "back in some of them): rerun with a pinned backend.loss_path, or pass "
                           "--allow-mixed-loss-paths (same gradients; diagnostics are rounded differently)")
    result.update(
        treatment=treatment, baseline=baseline, eval_name=names[0], per_seed=per_seed, arms=arms,
        decision_rule=DECISION_RULE.format(conf=100 * (1 - alpha)),
        config_diff=config_diff, ignored_config_keys=list(IGNORED_CONFIG_KEYS), item_set_sha256=item_sha,
        inputs=[str(p) for p in paths], output_dir=str(out_dir), plots={}, notes=notes,
    )

    # everything is checked: from here on we write
    out_dir.mkdir(parents=True, exist_ok=True)
    if make_plots:
        from eval.plots import PlotRun, load_metrics
        from eval.plots import make_plots as _make_plots

        plot_runs = []
        for r, a in zip(ordered, arms):
            rows, metric_notes = load_metrics(r.path / "metrics.jsonl")
            notes += metric_notes
            plot_runs.append(PlotRun(label=r.arm, role=a["role"], seed=r.seed, metrics=rows,
                                     accuracy=a["accuracy"], wilson_low=a["wilson_low"],
                                     wilson_high=a["wilson_high"]))
        files, plot_notes = _make_plots(plot_runs, out_dir / PLOTS_DIR, f" ({treatment} vs {baseline})")
        notes += plot_notes
        result["plots"] = {k: os.path.relpath(v, out_dir) for k, v in files.items()}

    from eval.report import render_markdown

    atomic_write_text(out_dir / "compare.md", render_markdown(result, out_dir))
    atomic_write_json(out_dir / "compare.json", result)  # last: its presence means a complete report
    for name in ("compare.md", "compare.json"):
        os.chmod(out_dir / name, 0o644)  # the atomic writer's temp file is 0600
    return result


def _run_notes(runs: list[Run]) -> list[str]:
    notes = []
    revs = {str((r.info.get("git") or {}).get("rev")) for r in runs}
    if len(revs) > 1:
        notes.append(f"the runs were made at different git revisions: {sorted(revs)}")
    dirty = [r.arm for r in runs if (r.info.get("git") or {}).get("dirty")]
    if dirty:
        notes.append(f"run(s) {dirty} were made from a working tree with uncommitted changes")
    paths = {r.arm: _loss_path(r.path / "metrics.jsonl") for r in runs}
    if len(set(paths.values())) > 1:
        notes.append("the arms computed their loss on different paths (same gradients, different speed and "
                     f"metric rounding): {paths}")
    return notes


def _mixed_loss_paths(runs: list[Run]) -> dict[str, str | None]:
    """{arm: loss/path} when the runs' recorded loss paths differ, else {}."""
    paths = {r.arm: _loss_path(r.path / "metrics.jsonl") for r in runs}
    return paths if len(set(paths.values())) > 1 else {}


def _loss_path(metrics: Path) -> str | None:
    """`loss/path` (one_pass / two_pass) of a run's first metrics row, None if not recorded."""
    try:
        with metrics.open() as f:
            return json.loads(f.readline()).get("loss/path")
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Config keys allowed to differ between runs: "
                                       + ", ".join(IGNORED_CONFIG_KEYS))
    p.add_argument("paths", nargs="+", help="a sweep folder, or two run folders")
    p.add_argument("--treatment", default="dppo", help="loss name of the treatment arm (default dppo)")
    p.add_argument("--baseline", default="grpo", help="loss name of the baseline arm (default grpo)")
    p.add_argument("--alpha", type=float, default=0.05, help="1 - confidence level (default 0.05)")
    p.add_argument("--eval-name", default=None,
                   help="eval file eval/<NAME>.jsonl (default: config eval.name)")
    p.add_argument("--allow-config-diff", action="store_true",
                   help="compare even if configs differ outside the loss group (recorded in the report)")
    p.add_argument("--allow-mixed-loss-paths", action="store_true",
                   help="compare even if the runs computed their loss on different paths (loss/path)")
    p.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap RNG seed")
    p.add_argument("--out", default=None,
                   help="output folder (default: the sweep, or the runs' common parent)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-wandb", action="store_true",
                   help="do not log the comparison to wandb (default: logged when the arms logged to wandb)")
    args = p.parse_args(argv)
    try:
        result = compare(args.paths, treatment=args.treatment, baseline=args.baseline, alpha=args.alpha,
                         eval_name=args.eval_name, allow_config_diff=args.allow_config_diff,
                         n_bootstrap=args.bootstrap, seed=args.seed, out=args.out,
                         make_plots=not args.no_plots, allow_mixed_loss_paths=args.allow_mixed_loss_paths)
    except (CompareError, ValueError, FileNotFoundError) as e:
        print(f"eval.compare: error: {e}", file=sys.stderr)
        return 1
    if not args.no_wandb:
        from eval.wandb_log import log_compare

        try:
            log_compare(result)
        except Exception as e:  # noqa: BLE001 - compare.json/compare.md are written; say what failed
            print(f"eval.compare: the comparison was not logged to wandb: {type(e).__name__}: {e}",
                  file=sys.stderr)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
