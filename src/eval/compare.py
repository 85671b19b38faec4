"""`python -m eval.compare <sweep> | <run_a> <run_b> [--aa <A/A sweep>]`: the paired verdict of the arms.

Finds the runs (numbered subfolders of a sweep, or two run folders), checks that they are one
paired experiment (same items, configs equal outside the arms' switch and the per-run keys in
IGNORED_CONFIG_KEYS; the switch is the loss, or the one other key whose value differs, e.g.
`schedule.updates_per_batch`, with the baseline named `key=value`), pairs each treatment with the
baseline by seed and by item index, decides
with the runs' pre-registered `decision` rule (Holm-adjusted over several treatments; the other
methods are reported as secondary), and writes `compare.json`, `compare.md` and
`compare_plots/*.png` into the output folder, and prints the verdict lines (scope, estimate, the rule's
interval), notes and those paths (`--json`: compare.json itself). Bad input exits with status 2.
A sweep of one loss at several seeds (A/A) gets the between-seed spread instead of a verdict; given
as `--aa` beside an A/B sweep it says whether the A/B gap exceeds that spread.
Every check runs before anything is written, so a refused comparison leaves an existing
compare.json untouched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from eval.endpoints import (
    EndpointError,
    accuracy_by_step,
    auc_scores,
    common_steps,
    endpoint_scores,
    load_curve,
    steps_to_threshold,
)
from eval.records import read_item_records, summarize, wilson_interval
from eval.stats import (
    ESTIMANDS,
    METHOD_SCOPE,
    RULE_METHODS,
    RULE_TEXT,
    SCOPE_TEXT,
    bootstrap_means,
    bootstrap_p,
    hoeffding_half_width,
    hoeffding_p,
    holm_adjust,
    interval_verdict,
    mcnemar_directional_p,
    paired_compare,
    pvalue_verdict,
    resolve_method,
    seed_t_interval,
    seed_t_verdict,
    t_quantile,
    two_level_bootstrap_ci,
)
from trainer.config.enums import ENDPOINTS
from trainer.config.ignored_keys import IGNORED_CONFIG_KEYS  # which keys may differ between arms, and why
from trainer.config.losses import rules_owned_by
from trainer.utils.io import atomic_write_json, atomic_write_text

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
    switch_value: str | None = None  # `key=value` when the arms differ in a switch other than the loss

    @property
    def key(self) -> str:
        """The arm this run belongs to: its loss, or `key=value` of the sweep's switch (find_switch)."""
        return self.switch_value or self.loss

    @property
    def arm(self) -> str:
        return f"{self.key}_seed{self.seed}"

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


def check_configs(runs: list[Run], roles: dict[str, str], switch: str = "loss") -> list[str]:
    """Differences outside the ignore list (and the sweep's switch), and between the loss groups of one arm's
    seeds."""
    ref = runs[0]
    found: list[str] = []
    ignore = IGNORED_CONFIG_KEYS + (() if switch == "loss" else (switch,))
    for r in runs[1:]:
        for key, va, vb in config_differences(ref.config, r.config, ignore):
            found.append(f"{key}: {va!r} ({ref.arm}, {ref.path}) vs {vb!r} ({r.arm}, {r.path})")
    for loss, role in roles.items():
        same = [r for r in runs if r.key == loss]
        for r in same[1:]:
            for key, va, vb in config_differences(same[0].config["loss"], r.config["loss"], ignore=()):
                found.append(f"loss.{key}: {va!r} ({same[0].arm}) vs {vb!r} ({r.arm}): the {role} arm's "
                             "loss differs between seeds")
    # keys both loss configs have, other than the loss's identity, are settings the arms must share (the
    # token aggregation also decides the one-pass vs two-pass path): only the loss function may differ
    b = next((r for r in runs if roles[r.key] == "baseline"), None)
    for loss in (x for x in roles if roles[x] == "treatment" and b is not None):
        t = next(r for r in runs if r.key == loss)
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


def pair_by_seed(runs: list[Run], losses: list[str]) -> dict[int, dict[str, Run]]:
    """{seed: {loss: run}} for the arms `losses`; exactly one run per (arm, seed), every arm at every seed."""
    by_key: dict[tuple[str, int], Run] = {}
    for r in runs:
        if r.key not in losses:
            raise CompareError(f"run {r.path} is arm '{r.key}', neither the treatment "
                               f"'{'/'.join(losses[1:])}' nor the baseline '{losses[0]}' (set --treatment/--baseline)")
        if (r.key, r.seed) in by_key:
            raise CompareError(f"two runs of arm {r.arm}: {by_key[(r.key, r.seed)].path} and {r.path}; "
                               "compare needs exactly one run per (arm, seed)")
        by_key[(r.key, r.seed)] = r
    pairs: dict[int, dict[str, Run]] = {}
    for seed in sorted({r.seed for r in runs}):
        have = {loss: by_key[(loss, seed)] for loss in losses if (loss, seed) in by_key}
        for loss in losses:
            if loss not in have:
                other = next(iter(have.values()))
                raise CompareError(f"seed {seed} has no '{loss}' run to pair with {other.arm} ({other.path}): "
                                   "a seed present in one arm only cannot be paired")
        pairs[seed] = have
    return pairs


# ----------------------------------------------------------------------------- the arms' switch
def find_switch(runs: list[Run]) -> str | None:
    """What tells the arms apart: `loss` when the runs have several losses (the default switch), else the one
    config key whose value differs between them (e.g. `schedule.updates_per_batch`, `optimizer.lr`), whose
    runs then get `switch_value` = `key=value`; None when no key differs (an A/A sweep). Two differing keys
    with one loss are two switches at once: refused, naming the keys and runs (a comparison answers one
    question)."""
    if len({r.loss for r in runs}) > 1:
        return "loss"
    ref = runs[0]
    keys: dict[str, list[Run]] = {}
    for r in runs[1:]:
        for key, _, _ in config_differences(ref.config, r.config):
            keys.setdefault(key, []).append(r)
    if not keys:
        return None
    if len(keys) > 1:
        shown = "; ".join(f"{k} ({ref.path.name}: {flatten(ref.config).get(k)!r}, "
                          + ", ".join(f"{r.path.name}: {flatten(r.config).get(k)!r}" for r in rs[:3]) + ")"
                          for k, rs in sorted(keys.items())[:6])
        raise CompareError(f"the runs differ in {len(keys)} config keys, not one switch: {shown}: a comparison has "
                           "one switch between its arms (the loss, or one other key)")
    (switch,) = keys
    for r in runs:
        r.switch_value = f"{switch}={_value_text(flatten(r.config).get(switch))}"
    return switch


def _value_text(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def _arm_named(name: str, switch: str, arms: list[str]) -> str | None:
    """The arm `name` refers to: a loss name for the loss switch; for another switch `key=value` (or the value
    alone), matched by value, so `optimizer.lr=2e-4` names the arm whose config holds 0.0002."""
    if switch == "loss":
        return name if name in arms else None
    key, _, text = name.rpartition("=") if "=" in name else (switch, "=", name)
    if key != switch:
        return None
    want = _parse_value(text)
    for arm in arms:
        if _parse_value(arm.split("=", 1)[1]) == want:
            return arm
    return None


def _parse_value(text: str) -> Any:
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, str):
        try:
            return float(v)  # YAML 1.1 reads 2e-4 as a string
        except ValueError:
            return v
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


# ----------------------------------------------------------------------------- decision rule
@dataclass
class Rule:
    """The decision rule compare applies: the runs' `decision` config, with any --override-decision change."""

    method: str
    alpha: float
    margin: float
    endpoint: str
    step: int | None
    threshold: float | None
    baseline: str
    source: str  # "config" | "default (runs predate decision config)"
    overridden: list[str] = field(default_factory=list)  # "key: config value -> used value"
    requested: str = ""  # decision.method as written (`auto` resolves by the seeds per arm)
    resolution: str = ""  # how `method` was chosen

    @property
    def scope(self) -> str:
        return METHOD_SCOPE[self.method]

    def text(self) -> str:
        where = {"final": "final accuracy", "step": f"accuracy at step {self.step}",
                 "auc": "area under the eval curve (per item)"}[self.endpoint]
        return (RULE_TEXT[self.method].format(conf=100 * (1 - self.alpha), alpha=self.alpha)
                + f", endpoint {where}, margin {self.margin:g}")


def resolve_rule(runs: list[Run], cli: dict[str, Any], override: bool, n_seeds: int = 1) -> Rule:
    """The runs' pre-registered `decision` config, and the command line's changes to it (only with
    --override-decision). `auto` resolves by the seeds per arm on both sides before they are compared, so
    `--method seed_t` on a 3-seed sweep whose config says auto is not an override."""
    from trainer.config.schema import ConfigError, DecisionConfig

    raw = runs[0].config.get("decision")
    source = "config"
    if raw is None:
        raw, source = {}, "default (the runs' config has no `decision` group: made before it existed)"
    known = {f for f in DecisionConfig.__dataclass_fields__}
    try:
        cfg = DecisionConfig(**{k: v for k, v in raw.items() if k in known})
    except (ConfigError, TypeError) as e:
        raise CompareError(f"run {runs[0].path}: decision config: decision.{e}") from None
    changed = []
    for key, value in cli.items():
        # the threshold only sets a secondary (reported) endpoint: changing it decides nothing
        if value is None or value == getattr(cfg, key) or key == "threshold":
            continue
        if key == "method" and resolve_method(value, n_seeds)[0] == resolve_method(cfg.method, n_seeds)[0]:
            continue
        changed.append(f"{key}: {getattr(cfg, key)!r} -> {value!r}")
    if changed and not override:
        raise CompareError("the command line asks for another decision rule than the pre-registered one ("
                           + "; ".join(changed) + "); pass --override-decision to decide with it anyway (the "
                           "report then says so), or drop those options")
    merged = {**{k: getattr(cfg, k) for k in known}, **{k: v for k, v in cli.items() if v is not None}}
    try:
        cfg = DecisionConfig(**merged)
    except ConfigError as e:
        raise CompareError(f"decision rule: {e}") from None
    method, resolution = resolve_method(cfg.method, n_seeds)
    return Rule(method=method, alpha=cfg.alpha, margin=cfg.margin, endpoint=cfg.endpoint, step=cfg.step,
                threshold=cfg.threshold, baseline=cfg.baseline, source=source, overridden=changed,
                requested=cfg.method, resolution=resolution)


# ----------------------------------------------------------------------------- statistics
def method_table(t_SN: np.ndarray, b_SN: np.ndarray, alpha: float, margin: float, n_bootstrap: int,
                 seed: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, Any]]:
    """(item-level paired_compare, {method: estimate/interval/p/verdict/estimand}, helpers for Holm)."""
    item = paired_compare(t_SN, b_SN, alpha=alpha, n_bootstrap=0, seed=seed)
    diff, n_items, S = item["diff"], item["n_items"], item["n_seeds"]
    d_SN = t_SN.astype(np.float64) - b_SN.astype(np.float64)
    d_N = d_SN.mean(axis=0)
    methods: dict[str, dict[str, Any]] = {}
    methods["paired_hoeffding"] = {"estimate": diff, "ci_low": item["ci_low"], "ci_high": item["ci_high"],
                                   "p": hoeffding_p(diff, n_items, margin),
                                   "verdict": interval_verdict(diff, item["ci_low"], item["ci_high"], margin)}
    b_items, c_items = item["b_items"], item["c_items"]
    p_dir = mcnemar_directional_p(b_items, c_items)
    methods["mcnemar_exact"] = {"estimate": diff, "ci_low": None, "ci_high": None, "p": p_dir,
                                "p_two_sided": item["mcnemar_p"], "b_items": b_items, "c_items": c_items,
                                "verdict": pvalue_verdict(b_items, c_items, p_dir, alpha)}
    helpers: dict[str, Any] = {"n_items": n_items, "diff": diff}
    if n_bootstrap > 0:
        means = bootstrap_means(d_N, n_bootstrap, seed)
        lo, hi = (float(x) for x in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
        item["bootstrap_low"], item["bootstrap_high"] = lo, hi
        methods["paired_bootstrap"] = {"estimate": diff, "ci_low": lo, "ci_high": hi,
                                       "p": bootstrap_p(means, diff, margin),
                                       "verdict": interval_verdict(diff, lo, hi, margin)}
        helpers["bootstrap_means"] = means
    seed_level = None
    if S >= 2:
        D_S = d_SN.mean(axis=1)
        st = seed_t_interval(D_S, alpha, margin)
        methods["seed_t"] = {"estimate": st["mean"], "ci_low": st["ci_low"], "ci_high": st["ci_high"],
                             "p": st["p"], "verdict": seed_t_verdict(st["mean"], st["ci_low"], st["ci_high"],
                                                                     st["se"], margin)}
        if st["degenerate"]:
            methods["seed_t"]["note"] = ("every seed pair gave the same gap (sd 0): the t interval has no width "
                                         "to read, so the verdict is at best inconclusive")
        helpers["per_seed_diff"] = D_S
        seed_level = {"per_seed_diff": st["per_seed"], "mean": st["mean"], "sd": st["sd"], "se": st["se"],
                      "df": st["df"], "t_crit": st["t_crit"], "t_ci_low": st["ci_low"], "t_ci_high": st["ci_high"],
                      "t_p": st["p"]}
        if n_bootstrap > 0:
            # descriptive only: its percentile interval uses z-like quantiles of S resampled seeds and the
            # plug-in between-seed sd (biased by (S - 1) / S), so at few seeds it is too narrow and a verdict
            # read from it would not hold alpha; the seed-level verdict is the t interval's
            lo, hi, _ = two_level_bootstrap_ci(d_SN, alpha, n_bootstrap, seed)
            methods["two_level_bootstrap"] = {"estimate": diff, "ci_low": lo, "ci_high": hi, "p": None,
                                              "verdict": None, "note": "descriptive: not calibrated, no verdict"}
            seed_level.update(two_level_low=lo, two_level_high=hi)
    for name, m in methods.items():
        m["estimand"] = ESTIMANDS[name]
    item["seed_level"] = seed_level
    return item, methods, helpers


def rule_interval(method: str, helpers: dict[str, Any], level: float) -> tuple[float, float] | None:
    """The rule's interval at `level` (Holm's step-down level of this treatment); None for exact McNemar."""
    if method == "paired_hoeffding":
        h = hoeffding_half_width(helpers["n_items"], level)
        return max(-1.0, helpers["diff"] - h), min(1.0, helpers["diff"] + h)
    if method == "paired_bootstrap":
        lo, hi = np.quantile(helpers["bootstrap_means"], [level / 2, 1 - level / 2])
        return float(lo), float(hi)
    if method == "seed_t":
        st = seed_t_interval(helpers["per_seed_diff"], level)
        return st["ci_low"], st["ci_high"]
    return None


def decide_all(rows: list[dict[str, Any]], helpers: list[dict[str, Any]], rule: Rule) -> None:
    """Holm's step-down over the treatments: the j-th smallest rule p is decided at level alpha / (K - j),
    with the rule's own interval at that level (at K = 1 this is the plain rule); the first failure stops."""
    K = len(rows)
    ps = [r["methods"][rule.method]["p"] for r in rows]
    adj = holm_adjust(ps)
    still = True
    for j, i in enumerate(sorted(range(K), key=lambda i: ps[i])):
        row, level = rows[i], rule.alpha / (K - j)
        m = row["methods"][rule.method]
        iv = rule_interval(rule.method, helpers[i], level)
        if iv is None:
            verdict = pvalue_verdict(m["b_items"], m["c_items"], m["p"], level)
        elif rule.method == "seed_t":
            verdict = seed_t_verdict(m["estimate"], iv[0], iv[1], seed_t_interval(helpers[i]["per_seed_diff"])["se"],
                                     rule.margin)
        else:
            verdict = interval_verdict(m["estimate"], iv[0], iv[1], rule.margin)
        if verdict == "validated" and not still:
            verdict = "inconclusive"  # Holm stops at the first treatment that fails
        still = still and verdict == "validated"
        # the top-level numbers of a comparison are the rule's: its estimate, its interval at this
        # treatment's Holm level (None for the exact test) and its Holm-adjusted p (the rule's p when K = 1)
        row.update(p_rule=m["p"], p_holm=adj[i], holm_level=level, rule_ci=list(iv) if iv else None,
                   method=rule.method, estimate=m["estimate"], ci_low=iv[0] if iv else None,
                   ci_high=iv[1] if iv else None, p=adj[i])
        set_verdict(row, verdict, rule.scope)


def set_verdict(row: dict[str, Any], verdict: str, scope: str) -> None:
    """The verdict with its scope, in every form compare shows it (the token, the scope key, the scope in
    words and the headline sentence)."""
    from eval.report import headline

    row.update(verdict=verdict, verdict_scope=scope, verdict_about=SCOPE_TEXT[scope],
               headline=headline(verdict, scope, row["treatment"], row["baseline"]))


# the item-level Hoeffding numbers every comparison carries, under names that say so: the top-level
# ci_low / ci_high / p / verdict of a comparison are the decision rule's
_ITEM_RENAMES = {"ci_low": "hoeffding_ci_low", "ci_high": "hoeffding_ci_high", "half_width": "hoeffding_half_width",
                 "verdict": "hoeffding_verdict"}


def item_level(pc: dict[str, Any]) -> dict[str, Any]:
    """paired_compare's dict with its Hoeffding interval and verdict renamed (see _ITEM_RENAMES)."""
    return {_ITEM_RENAMES.get(k, k): v for k, v in pc.items() if k != "method"}


def per_seed_row(t_N: np.ndarray, b_N: np.ndarray, rule: Rule, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """One seed pair's item-level numbers and, when the rule is item-level, the rule's own interval, p and
    verdict on that pair (about these two checkpoints). A seed-level rule has no verdict on one seed pair:
    `method` and `verdict` are None there."""
    item, methods, _ = method_table(t_N[None, :], b_N[None, :], rule.alpha, rule.margin, n_bootstrap, seed)
    row = item_level(item)
    row.pop("seed_level", None)
    m = methods.get(rule.method) if METHOD_SCOPE[rule.method] == "fixed_checkpoints" else None
    row.update(method=rule.method if m else None, estimate=m["estimate"] if m else None,
               ci_low=m["ci_low"] if m else None, ci_high=m["ci_high"] if m else None, p=m["p"] if m else None,
               verdict=m["verdict"] if m else None, verdict_scope="fixed_checkpoints" if m else None)
    return row


# metric families that describe the training itself (wall-clock, fault and eval keys differ between any two runs)
_TRAINING_FAMILIES = ("loss/", "env/", "drift/", "entropy/", "mismatch/", "ratio/", "optim/", "tokens/")
# each loss's own objective value: different functions of the same tokens, unequal even when the gradients
# are identical (GRPO's clipped surrogate vs DPPO's REINFORCE surrogate), so it says nothing about whether
# the arms trained alike
_OBJECTIVE_KEYS = ("loss/value",)


def _rule_fraction_keys(losses: tuple[str, ...]) -> re.Pattern[str]:
    """loss/<rule>_frac of the two arms' own rules (the rule table's owners: grpo -> grpo_clip, dppo ->
    dppo_masked): every loss logs every rule's fraction, its own and the counterfactual ones (what the other
    arm's rule would have done to the same tokens). Rules of losses outside the comparison (a GSPO sequence
    clip in a GRPO vs DPPO sweep) do not tell the two arms apart."""
    return re.compile(r"^loss/(" + "|".join(re.escape(x) for x in rules_owned_by(losses)) + r")_frac$")


def switch_activity(pairs: dict[int, tuple[Run, Run]], loss_switch: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Did the switch that tells the arms apart act at all? Per seed pair (treatment, baseline): the largest
    fraction of the two arms' rules either arm logged at any update, and whether the two runs' training rows
    (the metric families in _TRAINING_FAMILIES but the objective value, update by update) are identical. The
    comparison is `inert` when every seed pair shows one of the two: both arms' rule fractions 0 at every
    update (no token was masked or clipped by either rule, so the losses computed the same gradients), or
    identical training rows (the arms trained identically).
    Then the verdict says nothing about the switch: the runs never exercised it. A switch other than the loss
    (a learning rate, updates per batch) acts without any rule firing: only identical rows count there."""
    from eval.plots import load_metrics

    per_seed, notes = [], []
    for seed, (t, b) in pairs.items():
        t_rows, t_notes = load_metrics(t.path / "metrics.jsonl")
        b_rows, b_notes = load_metrics(b.path / "metrics.jsonl")
        notes += [f"activity check: {n}" for n in t_notes + b_notes if "not found" not in n]
        if not t_rows or not b_rows:
            notes.append(f"seed {seed}: no training metrics in {t.arm} or {b.arm}: whether the switch acted is "
                         "unknown (not called inert)")
            per_seed.append({"seed": seed, "updates": 0, "identical_training_rows": None,
                             "max_rule_fraction": None, "rule_fractions_all_zero": None})
            continue
        rule_key = _rule_fraction_keys((t.loss, b.loss))
        fracs = {k: max(float(r[k]) for r in t_rows + b_rows if isinstance(r.get(k), (int, float)))
                 for k in {k for r in t_rows + b_rows for k in r if rule_key.match(k)}}
        identical = len(t_rows) == len(b_rows) and all(_training_part(x) == _training_part(y)
                                                       for x, y in zip(t_rows, b_rows))
        per_seed.append({"seed": seed, "updates": len(t_rows), "identical_training_rows": identical,
                         "max_rule_fraction": fracs, "rule_fractions_all_zero": bool(fracs) and not any(fracs.values())})
    inert = bool(per_seed) and all(x["identical_training_rows"] or (loss_switch and x["rule_fractions_all_zero"])
                                   for x in per_seed)
    return {"inert": inert, "per_seed": per_seed}, notes


def _training_part(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items()
            if (k in ("step", "update") or k.startswith(_TRAINING_FAMILIES)) and k not in _OBJECTIVE_KEYS}


def aa_spread(endpoint_by_seed: dict[int, np.ndarray], alpha: float) -> dict[str, Any]:
    """Between-seed spread of one arm: per-seed mean endpoint, its sd, and every seed pair's item-level test
    (what an A/B report would have said had the two seeds been the two arms)."""
    seeds = sorted(endpoint_by_seed)
    acc = {s: float(np.mean(endpoint_by_seed[s])) for s in seeds}
    pairs = []
    for i, a in enumerate(seeds):
        for b in seeds[i + 1:]:
            r = paired_compare(endpoint_by_seed[a], endpoint_by_seed[b], alpha=alpha, n_bootstrap=0)
            pairs.append({"seed_a": a, "seed_b": b, "diff": r["diff"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                          "mcnemar_p": r["mcnemar_p"], "discordance": (r["b"] + r["c"]) / r["n"],
                          "item_level_significant": bool(r["ci_low"] > 0 or r["ci_high"] < 0 or r["mcnemar_p"] < alpha)})
    values = np.array([acc[s] for s in seeds])
    return {"seeds": seeds, "accuracy_by_seed": {str(s): acc[s] for s in seeds}, "mean": float(values.mean()),
            "between_seed_sd": float(values.std(ddof=1)) if len(seeds) > 1 else None,
            "max_abs_pair_diff": max((abs(p["diff"]) for p in pairs), default=None),
            "mean_discordance": float(np.mean([p["discordance"] for p in pairs])) if pairs else None,
            "pairs": pairs, "pairs_item_level_significant": sum(p["item_level_significant"] for p in pairs)}


def aa_calibration(aa: dict[str, Any], gap_S: list[float], alpha: float) -> dict[str, Any]:
    """Is the A/B gap beyond the A/A noise floor? Two runs of the same arm at different seeds differ by
    sqrt(2) x the A/A between-seed sd; the mean of S seed-pair gaps by that / sqrt(S). The interval
    gap +- t_{K-1} x that (K = A/A seeds, whose sd is itself estimated) must exclude 0."""
    K, S = len(aa["seeds"]), len(gap_S)
    gap = float(np.mean(gap_S))
    sd = aa["between_seed_sd"]
    se = math.sqrt(2.0) * sd / math.sqrt(S)
    t_crit = t_quantile(1 - alpha / 2, K - 1)
    return {"observed_gap": gap, "aa_between_seed_sd": sd, "noise_sd_of_one_gap": math.sqrt(2.0) * sd,
            "noise_se_of_mean_gap": se, "df": K - 1, "t_crit": t_crit, "low": gap - t_crit * se,
            "high": gap + t_crit * se, "aa_max_abs_pair_diff": aa["max_abs_pair_diff"],
            "exceeds_aa_noise": bool(abs(gap) > t_crit * se),
            "exceeds_every_aa_pair": bool(abs(gap) > (aa["max_abs_pair_diff"] or 0.0))}

# ----------------------------------------------------------------------------- quiet paths to a verdict
#: the bootstrap's resamples and RNG seed are part of the rule when the bootstrap decides (its verdict on a
#: borderline sweep depends on them): other values are an override
DEFAULT_BOOTSTRAP, DEFAULT_BOOTSTRAP_SEED = 10000, 0


def quiet_paths(runs_all: list[Run], used: list[Run], paths: list[Path], losses: list[str], base: str,
                treatments: list[str], rule: Rule, n_bootstrap: int, seed: int,
                n_seeds: int) -> tuple[list[str], list[str]]:
    """(departures from the pre-registered comparison, notes). Each departure can turn a verdict into
    `validated` without changing a rule key: fewer treatments shrink Holm's family, two run folders of a
    larger sweep pick one seed pair, the bootstrap's RNG and resamples move a borderline interval, a runs'
    `decision` block edited after the preflight record (or differing between runs), fewer seeds than the
    plan. They are refused unless --override-decision, which records them like any other rule change."""
    found: list[str] = []
    notes: list[str] = []
    all_treatments = [x for x in losses if x != base]
    if sorted(treatments) != sorted(all_treatments):
        found.append(f"treatments: the runs hold {all_treatments}, --treatment keeps {treatments} (Holm's family "
                     f"shrinks from {len(all_treatments)} to {len(treatments)})")
    if len(paths) == 2 and paths[0].parent == paths[1].parent:
        others = sorted(p for p in paths[0].parent.iterdir()
                        if p.is_dir() and p.name.isdigit() and p not in paths and (p / "config.yaml").is_file())
        if others:
            found.append(f"inputs: two run folders of the sweep {paths[0].parent}, which holds "
                         f"{len(others) + 2} runs ({', '.join(p.name for p in others)} left out)")
    if rule.method == "paired_bootstrap" and (n_bootstrap, seed) != (DEFAULT_BOOTSTRAP, DEFAULT_BOOTSTRAP_SEED):
        found.append(f"bootstrap: {DEFAULT_BOOTSTRAP} resamples, seed {DEFAULT_BOOTSTRAP_SEED} -> {n_bootstrap} "
                     f"resamples, seed {seed} (the bootstrap decides)")
    decisions = {json.dumps(r.config.get("decision"), sort_keys=True, default=str): r for r in used}
    if len(decisions) > 1:
        arms = [f"{r.arm} ({r.path})" for r in decisions.values()]
        found.append(f"decision: the runs' `decision` blocks differ ({', '.join(arms)})")
    rec, where = preflight_record(used[0])
    if rec is not None and rec.get("plan_hash_without_decision") not in (None, _plan_key(used[0])):
        notes.append(f"the preflight design record {where} is for another plan (its config differs from the runs' "
                     "outside the decision rule): the rule was not checked against it")
        rec = None
    if rec is not None:
        planned = rec.get("decision")
        have = used[0].config.get("decision") or {}
        if planned is not None:
            diff = [f"{k}: {planned.get(k)!r} -> {have.get(k)!r}" for k in sorted(set(planned) | set(have))
                    if planned.get(k) != have.get(k)]
            if diff:
                found.append(f"decision: the runs' config differs from the preflight record {where} ("
                             + ", ".join(diff) + ")")
        n_plan = (rec.get("design") or {}).get("n_seeds")
        if isinstance(n_plan, int) and n_seeds < n_plan:
            found.append(f"seeds: the plan ({where}) has {n_plan} seeds per arm, this comparison {n_seeds}")
    elif where:
        notes.append(f"no preflight design record at {where}: the decision rule was not checked against a plan")
    return found, notes


def _plan_key(run: Run) -> str:
    """The run's plan hash without its decision block, as the design gate records it
    (trainer.preflight.gates.plan_hash_without_decision), from the same torch-free digest."""
    from trainer.config.digest import config_hash
    from trainer.config.ignored_keys import PLAN_IGNORED_KEYS

    return config_hash(run.config, ("hydra", "decision") + PLAN_IGNORED_KEYS)


def preflight_record(run: Run) -> tuple[dict[str, Any] | None, str | None]:
    """(the design gate's meta, its path) for the run's experiment, when the run required the gates or the
    record exists. The folder is the run's preflight.dir (default preflight_runs/<experiment>), relative to the
    folder training ran from: the current directory, else the folder above the sweep's multirun/ tree."""
    pre = run.config.get("preflight") or {}
    rel = pre.get("dir") or (f"preflight_runs/{run.config.get('experiment')}" if run.config.get("experiment") else None)
    if not rel:
        return None, None
    cands = [Path(rel)] if Path(rel).is_absolute() else [Path.cwd() / rel] + [
        a / rel for a in run.path.parents if (a / "multirun").is_dir() or (a / "conf").is_dir()]
    for c in cands:
        f = c / "preflight" / "design.json"
        if f.is_file():
            try:
                return (json.loads(f.read_text()).get("meta") or {}), str(f)
            except (OSError, ValueError):
                raise CompareError(f"run {run.path}: the preflight record {f} is not valid JSON") from None
    return None, (str(cands[0] / "preflight" / "design.json") if pre.get("skip") is False else None)


def record_looks(result: dict[str, Any], out_dir: Path) -> None:
    """Repeated looks: an earlier compare.json in the output folder of the same comparison (items, arms,
    endpoint) with fewer seeds is an earlier look at data that grew. The rule holds alpha for one look; every
    look is listed, and the report says how many there were."""
    prev_file = out_dir / "compare.json"
    looks: list[dict[str, Any]] = []
    if prev_file.is_file():
        try:
            prev = json.loads(prev_file.read_text())
        except (OSError, ValueError):
            prev = {}
        same = (prev.get("mode") == "ab" and prev.get("item_set_sha256") == result["item_set_sha256"]
                and prev.get("baseline") == result["baseline"] and prev.get("treatments") == result["treatments"]
                and (prev.get("decision") or {}).get("endpoint") == result["decision"]["endpoint"])
        if same:
            looks = [x for x in prev.get("looks") or [] if x["n_seeds"] < result["n_seeds"]]
            if prev.get("n_seeds", result["n_seeds"]) < result["n_seeds"]:
                looks.append({"n_seeds": prev["n_seeds"], "seeds": prev.get("seeds"),
                              "verdicts": {v["treatment"]: v["verdict"] for v in prev.get("verdicts") or []
                                           if isinstance(v, dict)}})
    result["looks"] = looks
    if looks:
        result["notes"].append(
            f"look {len(looks) + 1} at this comparison: earlier compare.json at "
            + ", ".join(f"{x['n_seeds']} seed(s) ({x['verdicts']})" for x in looks)
            + f"; the rule's alpha = {result['alpha']:g} holds for one pre-planned look, so re-deciding as seeds are "
            "added raises the false-positive rate above it")


# ----------------------------------------------------------------------------- main entry
def _final_step(run: Run) -> int:
    return int(((run.config.get("schedule") or {}).get("num_steps")) or 0)


def _load_inputs(paths: list[Path], eval_name: str | None, out: str | Path | None) -> tuple[list[Run], Path]:
    if len(paths) == 1:
        if (paths[0] / "config.yaml").is_file():
            raise CompareError(f"{paths[0]} is a single run folder; pass its sweep folder or two run folders")
        runs = [load_run(p, eval_name, job) for job, p in discover_runs(paths[0])]
        return runs, Path(out).resolve() if out else paths[0]
    if len(paths) == 2:
        if paths[0] == paths[1]:
            raise CompareError(f"the two run folders are the same: {paths[0]}")
        runs = [load_run(p, eval_name) for p in paths]
        a, b = runs
        if a.seed != b.seed and (a.loss != b.loss or config_differences(a.config, b.config)):
            raise CompareError(f"the two runs have different seeds ({a.arm}: {a.path}, {b.arm}: {b.path}); "
                               "arms are paired within one seed")
        return runs, Path(out).resolve() if out else Path(os.path.commonpath([str(p) for p in paths]))
    raise CompareError(f"expected one sweep folder or two run folders, got {len(paths)} paths")


def _curves_and_scores(runs: list[Run], rule: Rule, order: list[int]) -> tuple[dict, list[int], dict, list[str]]:
    """Each run's eval curve, the steps all runs share, each run's endpoint scores, notes."""
    finals = {_final_step(r) for r in runs}
    if len(finals) != 1:
        raise CompareError(f"the runs have different schedule.num_steps: {sorted(finals)}")
    final_step = finals.pop()
    try:
        curves = {r.arm: load_curve(f"{r.arm} ({r.path})", r.path / "eval", r.eval_name, final_step, r.records)
                  for r in runs}
        steps, notes = common_steps(curves)
        if rule.endpoint != "final" and notes:
            raise CompareError("endpoint=" + rule.endpoint + " needs the same eval steps in every run: "
                               + "; ".join(notes))
        scores = {r.arm: endpoint_scores(curves[r.arm], rule.endpoint, rule.step, steps, order, final_step,
                                         f"{r.arm} ({r.path})") for r in runs}
    except EndpointError as e:
        raise CompareError(str(e)) from None
    return curves, steps, scores, notes


def _stack(scores: dict[str, np.ndarray], runs: list[Run]) -> np.ndarray:
    return np.stack([scores[r.arm] for r in runs])


def _curve_table(curves: dict, steps: list[int], pairs: dict[int, dict[str, Run]], baseline: str,
                 treatments: list[str], alpha: float, threshold: float | None) -> dict[str, Any] | None:
    """Accuracy vs step per arm (mean over seeds, interval), the paired per-step difference, the
    per-item area under the curve (paired) and steps to threshold; None with fewer than 2 shared steps."""
    if len(steps) < 2:
        return None
    seeds = list(pairs)
    S = len(seeds)
    arms: dict[str, Any] = {}
    acc_SK: dict[str, np.ndarray] = {}
    for loss in [baseline] + treatments:
        a = np.array([accuracy_by_step(curves[pairs[s][loss].arm], steps) for s in seeds])
        acc_SK[loss] = a
        n_items = len(next(iter(curves[pairs[seeds[0]][loss].arm].values())))
        lows, highs = [], []
        for k in range(len(steps)):
            if S >= 2:
                st = seed_t_interval(a[:, k], alpha)
                lows.append(st["ci_low"])
                highs.append(st["ci_high"])
            else:
                lo, hi = wilson_interval(round(a[0, k] * n_items), n_items, alpha)
                lows.append(lo)
                highs.append(hi)
        arms[loss] = {"accuracy": a.mean(axis=0).tolist(), "low": [max(0.0, x) for x in lows],
                      "high": [min(1.0, x) for x in highs],
                      "interval": "t over seeds" if S >= 2 else "Wilson"}
    if threshold is None:
        threshold = float(acc_SK[baseline][:, -1].mean())
    reach = {loss: {str(s): steps_to_threshold(acc_SK[loss][i].tolist(), steps, threshold)
                    for i, s in enumerate(seeds)} for loss in acc_SK}
    per_treatment = {}
    for loss in treatments:
        rows = []
        for k, step in enumerate(steps):
            order = sorted(curves[pairs[seeds[0]][baseline].arm][step])
            t = np.stack([[curves[pairs[s][loss].arm][step][i] for i in order] for s in seeds])
            b = np.stack([[curves[pairs[s][baseline].arm][step][i] for i in order] for s in seeds])
            r = paired_compare(t, b, alpha=alpha, n_bootstrap=0)
            row = {"step": step, "diff": r["diff"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                   "mcnemar_p": r["mcnemar_p"]}
            if S >= 2:
                st = seed_t_interval((t.astype(float) - b).mean(axis=1), alpha)
                row.update(seed_t_low=st["ci_low"], seed_t_high=st["ci_high"])
            rows.append(row)
        order = sorted(curves[pairs[seeds[0]][baseline].arm][steps[-1]])
        auc_t = np.stack([auc_scores(curves[pairs[s][loss].arm], steps, order) for s in seeds])
        auc_b = np.stack([auc_scores(curves[pairs[s][baseline].arm], steps, order) for s in seeds])
        r = paired_compare(auc_t, auc_b, alpha=alpha, n_bootstrap=0)
        auc = {"treatment": r["acc_treatment"], "baseline": r["acc_baseline"], "diff": r["diff"],
               "ci_low": r["ci_low"], "ci_high": r["ci_high"], "sign_test_p": r["mcnemar_p"],
               "items_higher": r["b_items"], "items_lower": r["c_items"]}
        if S >= 2:
            st = seed_t_interval((auc_t - auc_b).mean(axis=1), alpha)
            auc.update(seed_t_low=st["ci_low"], seed_t_high=st["ci_high"])
        gaps = [reach[loss][str(s)] - reach[baseline][str(s)] for s in seeds
                if reach[loss][str(s)] is not None and reach[baseline][str(s)] is not None]
        per_treatment[loss] = {"by_step": rows, "auc": auc,
                               "steps_to_threshold_diff": gaps,
                               "steps_to_threshold_mean_diff": float(np.mean(gaps)) if gaps else None}
    return {"steps": steps, "arms": arms, "threshold": threshold, "steps_to_threshold": reach,
            "treatments": per_treatment, "per_step_tests": PER_STEP_NOTE}


# the curve's per-step intervals and p-values are many looks at one comparison: none of them is adjusted
PER_STEP_NOTE = ("unadjusted, exploratory: one interval and one p per eval step and for the area under the "
                 "curve, with no correction for the number of steps; they decide nothing (the verdict is the "
                 "decision rule's on its pre-registered endpoint)")


def _load_aa(aa: str | Path, eval_name: str, item_sha: str, ref: Run, rule: Rule, order: list[int],
             allow_config_diff: bool, switch: str = "loss", arms: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """The A/A sweep's between-seed spread on the same endpoint and items; refuses a sweep that is not an
    A/A of this experiment: several arms, or one arm whose switch value is none of the A/B arms'."""
    path = Path(aa).resolve()
    runs = [load_run(p, eval_name, job) for job, p in discover_runs(path)]
    losses = sorted({r.loss for r in runs})
    try:
        aa_switch = find_switch(runs)
    except CompareError as e:
        raise CompareError(f"--aa {path}: not an A/A sweep: {e}") from None
    if len(losses) != 1 or aa_switch is not None:
        raise CompareError(f"--aa {path}: not an A/A sweep: its runs differ in {aa_switch} (an A/A sweep runs one "
                           "arm at several seeds: python train.py --multirun loss=grpo seed=0,1,2)")
    value = losses[0] if switch == "loss" else f"{switch}={_value_text(flatten(runs[0].config).get(switch))}"
    if arms and _arm_named(value, switch, list(arms)) is None:
        raise CompareError(f"--aa {path}: its runs ({', '.join(r.path.name for r in runs)}) are the arm "
                           f"'{value}', none of this comparison's arms {list(arms)}")
    seeds = sorted(r.seed for r in runs)
    if len(set(seeds)) != len(seeds):
        raise CompareError(f"--aa {path}: two runs share a seed ({seeds})")
    if len(seeds) < 2:
        raise CompareError(f"--aa {path}: an A/A sweep needs >= 2 seeds, it has {seeds}")
    # the decision group only says how to read the runs: an A/A made under another rule still measures the noise
    skip = IGNORED_CONFIG_KEYS + ("decision",) + (() if switch == "loss" else (switch,))
    diffs = [f"{k}: {va!r} (A/B {ref.arm}) vs {vb!r} (A/A {r.arm})" for r in runs
             for k, va, vb in config_differences(ref.config, r.config, skip)]
    if diffs and not allow_config_diff:
        raise CompareError(f"--aa {path}: the A/A runs' configs differ from the A/B runs' outside the loss group "
                           "(another experiment or setting?); pass --allow-config-diff to use it anyway: "
                           + "; ".join(diffs[:20]))
    for r in runs:
        load_records(r)
    sha = check_item_sets(runs)
    if sha != item_sha:
        raise CompareError(f"--aa {path}: the A/A runs evaluated other items than the A/B runs (item set sha256 "
                           f"{sha[:12]} vs {item_sha[:12]})")
    _, _, scores, notes = _curves_and_scores(runs, rule, order)
    spread = aa_spread({r.seed: scores[r.arm] for r in runs}, rule.alpha)
    spread.update(sweep=str(path), loss=losses[0])
    return spread, [f"A/A: {n}" for n in notes] + [f"A/A config differs (allowed): {d}" for d in diffs]


def compare(paths: list[str | Path], treatment: str | list[str] | None = None, baseline: str | None = None,
            alpha: float | None = None, eval_name: str | None = None, allow_config_diff: bool = False,
            n_bootstrap: int = DEFAULT_BOOTSTRAP, seed: int = DEFAULT_BOOTSTRAP_SEED, out: str | Path | None = None,
            make_plots: bool = True,
            method: str | None = None, margin: float | None = None, endpoint: str | None = None,
            step: int | None = None, threshold: float | None = None, override_decision: bool = False,
            aa: str | Path | None = None, allow_mixed_loss_paths: bool = False) -> dict[str, Any]:
    """Run all checks, compute the statistics and write compare.json / compare.md / plots.

    The decision rule comes from the runs' `decision` config; method/alpha/margin/endpoint/step/threshold/
    baseline given here must equal it unless override_decision (then the report says what changed)."""
    if alpha is not None and not 0 < alpha < 1:
        raise CompareError(f"--alpha must be in (0, 1), got {alpha}")
    if n_bootstrap < 0:
        raise CompareError(f"--bootstrap must be >= 0, got {n_bootstrap}")
    treatments_given = ([t for t in treatment.split(",") if t] if isinstance(treatment, str)
                        else list(treatment) if treatment else [])
    if baseline is not None and baseline in treatments_given:
        raise CompareError(f"--treatment and --baseline are both '{baseline}'")
    paths = [Path(p).resolve() for p in paths]
    runs, out_dir = _load_inputs(paths, eval_name, out)
    names = [runs[0].eval_name]
    if any(r.eval_name != names[0] for r in runs):
        raise CompareError("runs have different eval names: "
                           + ", ".join(f"{r.path.name}={r.eval_name}" for r in runs) + " (pass --eval-name)")
    rule = resolve_rule(runs, {"method": method, "alpha": alpha, "margin": margin, "endpoint": endpoint,
                               "step": step, "threshold": threshold, "baseline": baseline}, override_decision,
                        n_seeds=len({r.seed for r in runs}))
    switch = find_switch(runs)
    losses = sorted({r.key for r in runs})
    notes: list[str] = []
    if switch is None:
        if treatments_given:
            raise CompareError(f"A/A sweep passed as A/B: every run has loss '{losses[0]}' (seeds "
                               f"{sorted(r.seed for r in runs)}), so there is no treatment arm to compare; "
                               "drop --treatment for the A/A report (between-seed spread), or pass this folder "
                               "as --aa to the comparison of an A/B sweep")
        if aa is not None:
            raise CompareError("--aa calibrates an A/B comparison, but the runs given are themselves an A/A "
                               f"sweep (loss '{losses[0]}' only)")
        return _compare_aa(runs, rule, names[0], paths, out_dir, allow_config_diff, make_plots)
    base = _arm_named(rule.baseline, switch, losses)
    if base is None:
        how = ("" if switch == "loss" else f"; the arms differ in {switch}, so name the baseline as "
               f"decision.baseline='{switch}=<value>' (or --baseline {losses[0]} --override-decision)")
        raise CompareError(f"the baseline '{rule.baseline}' (decision.baseline / --baseline) names no arm; the runs' "
                           f"arms are {losses} ({', '.join(str(r.path) for r in runs[:4])}"
                           f"{', ...' if len(runs) > 4 else ''}){how}")
    named = []
    for t in treatments_given:
        arm = _arm_named(t, switch, losses)
        if arm is None:
            raise CompareError(f"no run has the treatment arm '{t}': the runs' arms are {losses} (set "
                               "--treatment/--baseline)")
        if arm == base:
            raise CompareError(f"--treatment and --baseline are both '{t}'")
        named.append(arm)
    treatments_given = named
    treatments = treatments_given or [x for x in losses if x != base]
    runs_all = list(runs)
    left_out = [r for r in runs if r.key not in treatments and r.key != base]
    if left_out:
        notes.append("runs left out by --treatment: " + ", ".join(r.arm for r in left_out))
        runs = [r for r in runs if r not in left_out]
    pairs = pair_by_seed(runs, [base] + treatments)
    roles = {base: "baseline", **{t: "treatment" for t in treatments}}
    ordered = [pairs[s][loss] for s in pairs for loss in [base] + treatments]  # baseline first: the reference
    config_diff = check_configs(ordered, roles, switch)
    if config_diff and not allow_config_diff:
        # one line, naming each key with both values and runs: a second switch beside the arms' own is refused
        shown = "; ".join(config_diff[:20]) + ("; ..." if len(config_diff) > 20 else "")
        where = "the `loss` group" if switch == "loss" else f"the arms' switch `{switch}`"
        raise CompareError(f"configs differ outside {where} (a second switch, or a different experiment?); "
                           f"pass --allow-config-diff to compare anyway: {shown}")
    check_precision(ordered, allow_config_diff)
    mixed = _mixed_loss_paths(ordered)
    if mixed and not (allow_mixed_loss_paths or allow_config_diff):
        raise CompareError(f"the runs computed their loss on different paths {mixed} (backend.loss_path=auto fell "
                           "back in some of them): rerun with a pinned backend.loss_path, or pass "
                           "--allow-mixed-loss-paths (same gradients; diagnostics are rounded differently)")
    for r in ordered:
        load_records(r)
    item_sha = check_item_sets(ordered)
    order = sorted(r["index"] for r in ordered[0].records)
    curves, steps, scores, curve_notes = _curves_and_scores(ordered, rule, order)
    notes += curve_notes
    seeds = list(pairs)
    if rule.method == "seed_t" and len(seeds) < 2:
        raise CompareError(f"the decision rule is seed_t (over seeds), but this comparison has {len(seeds)} seed "
                           f"per arm ({seeds}); run >= 2 seeds (seed=0,1,2) or decide with an item-level method "
                           "(--method paired_hoeffding --override-decision)")
    if rule.method == "paired_bootstrap" and n_bootstrap == 0:
        raise CompareError("the decision rule is paired_bootstrap, but --bootstrap 0 turns the bootstrap off")
    quiet, quiet_notes = quiet_paths(runs_all, ordered, paths, losses, base, treatments, rule, n_bootstrap, seed,
                                     len(seeds))
    notes += quiet_notes
    if quiet and not override_decision:
        raise CompareError("this comparison departs from the pre-registered one (" + "; ".join(quiet) + "); pass "
                           "--override-decision to decide anyway (the report then says so), or compare the whole "
                           "sweep under its own rule")
    rule.overridden += quiet
    aa_spread_, aa_notes = (None, [])
    if aa is not None:
        aa_spread_, aa_notes = _load_aa(aa, names[0], item_sha, ordered[0], rule, order, allow_config_diff,
                                        switch, tuple([base] + treatments))
        notes += aa_notes

    rows, helpers = [], []
    for loss in treatments:
        t_SN = _stack(scores, [pairs[s][loss] for s in seeds])
        b_SN = _stack(scores, [pairs[s][base] for s in seeds])
        item, methods, h = method_table(t_SN, b_SN, rule.alpha, rule.margin, n_bootstrap, seed)
        per_seed = []
        for i, s in enumerate(seeds):
            r = per_seed_row(t_SN[i], b_SN[i], rule, n_bootstrap, seed)
            r.update(seed=s, treatment_arm=pairs[s][loss].arm, baseline_arm=pairs[s][base].arm)
            per_seed.append(r)
        row = {"treatment": loss, "baseline": base, **item_level(item), "per_seed": per_seed, "methods": methods,
               "bootstrap_resamples": int(n_bootstrap), "bootstrap_seed": int(seed)}
        if aa_spread_ is not None:
            row["aa_calibration"] = aa_calibration(aa_spread_, list(h.get("per_seed_diff", [item["diff"]])),
                                                   rule.alpha)
        rows.append(row)
        helpers.append(h)
    decide_all(rows, helpers, rule)
    for row, loss in zip(rows, treatments):
        row["activity"], act_notes = switch_activity({s: (pairs[s][loss], pairs[s][base]) for s in seeds},
                                                     loss_switch=switch == "loss")
        notes += act_notes
        if row["activity"]["inert"]:
            set_verdict(row, "inert", rule.scope)
    for row in rows:  # a verdict the A/A noise floor contradicts is said next to it, not pages below
        cal = row.get("aa_calibration")
        if cal and row["verdict"] == "validated" and not cal["exceeds_aa_noise"]:
            notes.append(f"{row['treatment']} vs {base}: validated ({row['verdict_about']}), but the gap "
                         f"{100 * cal['observed_gap']:+.2f} pts does NOT exceed the A/A noise floor (interval "
                         f"[{100 * cal['low']:+.2f}, {100 * cal['high']:+.2f}] pts): two seeds of one arm differ "
                         "by as much")
    curve = _curve_table(curves, steps, pairs, base, treatments, rule.alpha, rule.threshold)

    arms = []
    for r in ordered:
        summ = summarize(r.records, alpha=rule.alpha)
        arms.append({"arm": r.arm, "role": roles[r.key], "loss": r.loss, "value": r.key, "seed": r.seed,
                     "run": str(r.path),
                     "job": r.job, "run_name": r.info.get("arm", r.config.get("run_name")),
                     "eval_file": str(r.eval_file), "endpoint_mean": float(np.mean(scores[r.arm])), **summ})
    notes += _run_notes(ordered)
    result: dict[str, Any] = {
        "mode": "ab", "switch": switch, "treatments": treatments, "baseline": base, "eval_name": names[0],
        "verdict_scope": rule.scope, "verdict_about": SCOPE_TEXT[rule.scope],
        "n_seeds": len(seeds), "seeds": seeds, "decision": _rule_dict(rule), "comparisons": rows,
        "verdicts": [{k: r[k] for k in _VERDICT_KEYS} for r in rows], "curve": curve, "aa": aa_spread_,
        "arms": arms, "config_diff": config_diff, "ignored_config_keys": list(IGNORED_CONFIG_KEYS),
        "item_set_sha256": item_sha, "inputs": [str(p) for p in paths], "output_dir": str(out_dir), "plots": {},
        "notes": notes,
        # kept from the one-treatment report: the alpha, method and decision-rule text at the top level
        "alpha": rule.alpha, "method": rule.method, "decision_rule": rule.text(),
    }
    record_looks(result, out_dir)
    if len(rows) == 1:  # one treatment: its numbers (the rule's estimate, interval, p, verdict) at the top level
        result.update({k: v for k, v in rows[0].items() if k not in result or k in ("verdict", "method")},
                      treatment=treatments[0])
    return _write(result, ordered, roles, out_dir, make_plots, f" ({', '.join(treatments)} vs {base})")


#: one entry of compare.json's `verdicts`: what the verdict is about, and the rule's numbers behind it
_VERDICT_KEYS = ("treatment", "baseline", "verdict", "verdict_scope", "verdict_about", "headline", "method",
                 "estimate", "ci_low", "ci_high", "p", "holm_level")


def _rule_dict(rule: Rule) -> dict[str, Any]:
    return {"method": rule.method, "requested": rule.requested, "resolution": rule.resolution,
            "alpha": rule.alpha, "margin": rule.margin, "endpoint": rule.endpoint,
            "step": rule.step, "threshold": rule.threshold, "baseline": rule.baseline, "source": rule.source,
            "overridden": rule.overridden, "text": rule.text(), "estimand": ESTIMANDS[rule.method],
            "scope": rule.scope, "bootstrap_resamples": DEFAULT_BOOTSTRAP, "bootstrap_seed": DEFAULT_BOOTSTRAP_SEED}


def _compare_aa(runs: list[Run], rule: Rule, eval_name: str, paths: list[Path], out_dir: Path,
                allow_config_diff: bool, make_plots: bool) -> dict[str, Any]:
    """One loss at several seeds: the between-seed spread (the noise floor of an A/B gap)."""
    seeds = sorted(r.seed for r in runs)
    if len(set(seeds)) != len(seeds):
        raise CompareError(f"two runs of one arm share a seed: {[r.arm for r in runs]}")
    if len(seeds) < 2:
        raise CompareError(f"one run of loss '{runs[0].loss}' only: nothing to compare (an A/A sweep needs "
                           ">= 2 seeds, an A/B sweep two losses)")
    runs = sorted(runs, key=lambda r: r.seed)
    roles = {runs[0].loss: "baseline"}
    config_diff = check_configs(runs, {runs[0].loss: "A/A"})
    if config_diff and not allow_config_diff:
        raise CompareError("configs differ outside the `loss` group; pass --allow-config-diff to compare anyway: "
                           + "; ".join(config_diff[:20]))
    check_precision(runs, allow_config_diff)
    for r in runs:
        load_records(r)
    item_sha = check_item_sets(runs)
    order = sorted(r["index"] for r in runs[0].records)
    _, _, scores, notes = _curves_and_scores(runs, rule, order)
    spread = aa_spread({r.seed: scores[r.arm] for r in runs}, rule.alpha)
    spread.update(sweep=str(paths[0]), loss=runs[0].loss)
    arms = [{"arm": r.arm, "role": "A/A", "loss": r.loss, "seed": r.seed, "run": str(r.path), "job": r.job,
             "run_name": r.info.get("arm"), "eval_file": str(r.eval_file),
             "endpoint_mean": float(np.mean(scores[r.arm])), **summarize(r.records, alpha=rule.alpha)} for r in runs]
    result = {"mode": "aa", "verdict": None, "verdict_scope": "across_seeds", "baseline": runs[0].loss,
              "treatments": [], "eval_name": eval_name, "n_seeds": len(seeds), "seeds": seeds, "n_items": len(order),
              "decision": _rule_dict(rule), "aa": spread, "arms": arms, "config_diff": config_diff,
              "ignored_config_keys": list(IGNORED_CONFIG_KEYS), "item_set_sha256": item_sha,
              "inputs": [str(p) for p in paths], "output_dir": str(out_dir), "plots": {},
              "notes": notes + _run_notes(runs), "alpha": rule.alpha, "method": rule.method,
              "decision_rule": rule.text()}
    return _write(result, runs, roles, out_dir, make_plots, f" (A/A: {runs[0].loss})")


def _write(result: dict[str, Any], runs: list[Run], roles: dict[str, str], out_dir: Path, make_plots: bool,
           title_suffix: str) -> dict[str, Any]:
    """Everything is checked: from here on we write (plots, compare.md, then compare.json last)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = result["notes"]
    if make_plots:
        from eval.plots import PlotRun, load_metrics, plot_eval_curve
        from eval.plots import make_plots as _make_plots

        plot_runs = []
        for r, a in zip(runs, result["arms"]):
            rows, metric_notes = load_metrics(r.path / "metrics.jsonl")
            notes += metric_notes
            plot_runs.append(PlotRun(label=r.arm, role=roles.get(r.key, "baseline"), seed=r.seed, metrics=rows,
                                     accuracy=a["accuracy"], wilson_low=a["wilson_low"],
                                     wilson_high=a["wilson_high"]))
        files, plot_notes = _make_plots(plot_runs, out_dir / PLOTS_DIR, title_suffix)
        notes += plot_notes
        if result.get("curve"):
            files["eval_curve"] = plot_eval_curve(result["curve"], out_dir / PLOTS_DIR / "eval_curve.png",
                                                  f"Eval accuracy vs step{title_suffix}")
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
    threads = {r.arm: r.info.get("torch_threads") for r in runs}
    if len(set(threads.values())) > 1:  # e.g. joblib caps each worker at one thread, a plain run uses all cores
        notes.append("the arms ran with different torch thread counts (their arithmetic differs in the last bits, "
                     f"so a rerun of one would not reproduce the other's numbers): {threads}; pin "
                     "backend.num_threads for reproducible arms")
    paths = {r.arm: _loss_path(r.path / "metrics.jsonl") for r in runs}
    if len(set(paths.values())) > 1:
        notes.append("the arms computed their loss on different paths (same gradients, different speed and "
                     f"metric rounding): {paths}")
    notes += _engine_notes(runs)
    for what, why in (("precision", ("the arms' arithmetic differs beyond the last bits, a difference the verdict "
                                     "cannot tell apart from the switch (refused unless --allow-config-diff)")),
                      ("cpu", "the same thread count and code give other numbers on another CPU"),
                      ("torch", "kernels and their rounding differ between torch versions")):
        seen = _run_info_values(runs, what)
        if len(set(seen.values())) > 1:
            notes.append(f"the arms ran with different {what} ({why}): {seen}")
    return notes


def _engine_notes(runs: list[Run]) -> list[str]:
    """A note when the arms' engine plans (run_info.json `engine`) differ: which ops ran native, on the AMX
    tiles or on oneDNN-packed weights decides the summation order, so neither arm's bits are what the other
    arm's code path would give (`PAIREDRL_TORCH_OPS`, another CPU or torch build). Names the fields."""
    engines = {r.arm: r.info.get("engine") or {} for r in runs}
    keys = sorted({k for e in engines.values() for k in e
                   if len({json.dumps(x.get(k), sort_keys=True) for x in engines.values()}) > 1})
    if not keys:
        return []
    return [f"the arms ran different engine plans (the ops' summation order differs, so one arm's numbers are not "
            f"what the other's plan would give): {', '.join(keys)}: "
            + "; ".join(f"{arm} {{{', '.join(f'{k}={e.get(k)}' for k in keys)}}}" for arm, e in engines.items())]


def _run_info_values(runs: list[Run], what: str) -> dict[str, str]:
    """{arm: value} of run_info.json's resolved `precision`, `cpu` model or torch version."""
    def get(r: Run) -> Any:
        if what == "torch":
            return (r.info.get("versions") or {}).get("torch")
        return r.info.get(what)
    return {r.arm: str(get(r)) for r in runs}


def check_precision(runs: list[Run], allow: bool) -> None:
    """Arms trained at different resolved precisions (backend dtype `auto` resolves per machine) are not one
    experiment: refused unless --allow-config-diff (then a note says so)."""
    seen = _run_info_values(runs, "precision")
    if len(set(seen.values())) > 1 and not allow:
        raise CompareError(f"the runs trained at different resolved precisions {seen} (run_info.json `precision`): "
                           "pin the backend dtypes, or pass --allow-config-diff to compare anyway")


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
    p.add_argument("paths", nargs="+", help="a sweep folder (A/B or A/A), or two run folders")
    p.add_argument("--treatment", default=None,
                   help="loss(es) of the treatment arm(s), comma-separated (default: every loss but the baseline)")
    p.add_argument("--baseline", default=None, help="loss of the baseline arm (default: decision.baseline)")
    p.add_argument("--aa", default=None, metavar="SWEEP",
                   help="an A/A sweep (one loss, >= 2 seeds) of this experiment: say whether the gap exceeds its "
                        "between-seed spread")
    p.add_argument("--eval-name", default=None,
                   help="eval file eval/<NAME>.jsonl (default: config eval.name)")
    p.add_argument("--allow-config-diff", action="store_true",
                   help="compare even if configs differ outside the loss group (recorded in the report)")
    p.add_argument("--allow-mixed-loss-paths", action="store_true",
                   help="compare even if the runs computed their loss on different paths (loss/path)")
    rule = p.add_argument_group("decision rule (default: the runs' pre-registered `decision` config; a "
                                "different value needs --override-decision)")
    rule.add_argument("--method", default=None, choices=("auto", *RULE_METHODS))
    rule.add_argument("--alpha", type=float, default=None, help="two-sided error rate")
    rule.add_argument("--margin", type=float, default=None, help="gain the lower bound must exceed")
    rule.add_argument("--endpoint", default=None, choices=ENDPOINTS)
    rule.add_argument("--step", type=int, default=None, help="eval step of --endpoint step")
    rule.add_argument("--threshold", type=float, default=None,
                      help="accuracy of the steps-to-threshold endpoint (reported only: no override needed)")
    rule.add_argument("--override-decision", action="store_true",
                      help="decide with the rule given here instead of the pre-registered one (the report says so)")
    p.add_argument("--bootstrap", type=int, default=DEFAULT_BOOTSTRAP,
                   help="bootstrap resamples (0 = off; another value is an override when the bootstrap decides)")
    p.add_argument("--seed", type=int, default=DEFAULT_BOOTSTRAP_SEED,
                   help="bootstrap RNG seed (another value is an override when the bootstrap decides)")
    p.add_argument("--out", default=None,
                   help="output folder (default: the sweep, or the runs' common parent)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-wandb", action="store_true",
                   help="do not log the comparison to wandb (default: logged when the arms logged to wandb)")
    p.add_argument("--json", action="store_true",
                   help="print compare.json on stdout (default: the verdict lines, notes and the report's paths)")
    args = p.parse_args(argv)
    try:
        result = compare(args.paths, treatment=args.treatment, baseline=args.baseline, alpha=args.alpha,
                         eval_name=args.eval_name, allow_config_diff=args.allow_config_diff,
                         n_bootstrap=args.bootstrap, seed=args.seed, out=args.out,
                         make_plots=not args.no_plots, method=args.method, margin=args.margin,
                         endpoint=args.endpoint, step=args.step, threshold=args.threshold,
                         override_decision=args.override_decision, aa=args.aa,
                         allow_mixed_loss_paths=args.allow_mixed_loss_paths)
    except (CompareError, ValueError, FileNotFoundError) as e:
        print(f"eval.compare: error: {e}", file=sys.stderr)
        return 2
    if not args.no_wandb:
        from eval.wandb_log import log_compare

        try:
            log_compare(result)
        except Exception as e:  # noqa: BLE001 - compare.json/compare.md are written; say what failed
            print(f"eval.compare: the comparison was not logged to wandb: {type(e).__name__}: {e}",
                  file=sys.stderr)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else summary(result))
    return 0


def summary(result: dict[str, Any]) -> str:
    """What a person reads first: each verdict with its scope, the rule's estimate and interval, the rule and
    any override, the notes, and where the report, the JSON and the plots are."""
    from eval.report import verdict_line

    out_dir = Path(result["output_dir"])
    rule = result["decision"]
    if result["mode"] == "aa":
        aa = result["aa"]
        sd = aa["between_seed_sd"]
        lines = [(f"A/A: {aa['loss']} at seeds {aa['seeds']}: between-seed sd of the endpoint "
                  f"{100 * sd:.2f} pts, largest seed-pair gap {100 * aa['max_abs_pair_diff']:.2f} pts "
                  f"({aa['pairs_item_level_significant']} of {len(aa['pairs'])} seed pairs item-level 'significant')")]
    else:
        lines = [verdict_line(r, rule) for r in result["comparisons"]]
        lines.append(f"rule: {rule['text']}"
                     + (f" ({rule['resolution']})" if rule.get("requested") == "auto" else ""))
    if rule["overridden"]:
        lines.append("OVERRIDDEN (not the pre-registered comparison): " + "; ".join(rule["overridden"]))
    lines += [f"note: {n}" for n in result["notes"]]
    lines += [f"compare.md: {out_dir / 'compare.md'}", f"compare.json: {out_dir / 'compare.json'}"]
    if result.get("plots"):
        lines.append(f"plots: {out_dir / PLOTS_DIR} ({', '.join(sorted(result['plots']))})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
