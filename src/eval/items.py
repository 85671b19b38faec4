"""The paired verdict on per-item results written anywhere: `python -m eval.compare --items
NAME=FILE[,FILE...] NAME=FILE[,FILE...] [--baseline NAME] [--format F] [--metric M] [--decision plan.yaml]`.

Each arm is one or more per-item result files (one per seed or checkpoint, in seed order), read by a format
adapter (eval/item_formats.py: lm-evaluation-harness `--log_samples`, the tinker-cookbook EvalStore,
prime-rl eval rollouts, verl validation dumps, plain JSONL/CSV). Items are matched by their stable id (a
content hash where the format has none): every file must hold the same item set, and an id seen twice in a
file, an item missing from one file, a metric missing from a line or an empty file is refused with a count,
never dropped. The scores then go through the same decision as a sweep (eval.comparison.score_rows, the
methods of eval.methods, sign_flip and equivalence included): one file per arm gives a verdict about these
checkpoints, several seeds per arm the seed-level rule (decision.method = auto), Holm over several
treatments. Planned sequential looks (decision.looks) are refused: their ledger lives beside the training
runs (eval.sequential), and files written elsewhere say nothing of where those ran or which looks came
before. The rule is pre-registered in a YAML of the `decision` block's keys
(`--decision plan.yaml`); without one the command line's options are the rule, and the report says that it
was not pre-registered. Items that carry a category (lm-eval subtasks, a `category` column) also get one
secondary result per (treatment, category), Holm-adjusted over all of them (they decide nothing).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from eval.comparison import (
    _VERDICT_KEYS,
    DEFAULT_BOOTSTRAP,
    DEFAULT_BOOTSTRAP_SEED,
    Rule,
    _rule_dict,
    _rule_notes,
    _write,
    aa_spread,
    check_decider,
    check_options,
    decide_all,
    earlier_looks,
    resolve_rule,
    score_rows,
)
from eval.item_formats import FORMATS, ItemFile, ItemsError, read_items
from eval.methods import METHODS, method_table
from eval.runs import CompareError, Run
from eval.stats import SCOPE_TEXT, wilson_interval

__all__ = ["Arm", "ItemsError", "compare_items", "load_arms", "load_plan", "match_items", "parse_arm"]

_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+:-]{0,63}$")
MAX_ARMS, MAX_FILES_PER_ARM = 64, 1000


@dataclass
class Arm:
    name: str
    files: list[ItemFile] = field(default_factory=list)  # one per seed, in seed order

    def label(self, seed: int) -> str:
        return f"{self.name}_seed{seed}"


def parse_arm(spec: str) -> tuple[str, list[Path]]:
    """`NAME=FILE[,FILE...]` -> (name, paths)."""
    name, eq, rest = spec.partition("=")
    if not eq or not rest:
        raise ItemsError(f"--items {spec!r}: expected NAME=FILE[,FILE...] (an arm's name, then its per-item "
                         "files, one per seed, comma-separated)")
    if not _ARM_NAME.match(name):
        raise ItemsError(f"--items {spec!r}: arm name {name!r} must be 1-64 characters of letters, digits "
                         "and _ . + : - (starting with a letter or digit)")
    paths = [Path(p) for p in rest.split(",")]
    if any(not str(p) for p in paths) or len(paths) > MAX_FILES_PER_ARM:
        raise ItemsError(f"--items {spec!r}: an empty file name, or more than {MAX_FILES_PER_ARM} files")
    for p in paths:
        if not p.exists():
            raise ItemsError(f"--items {name}: {p} not found")
    return name, paths


def load_arms(specs: list[str], fmt: str | None = None, metric: str | None = None) -> list[Arm]:
    """Read every arm's files. A plain file with a `seed` column may hold several seeds: it then counts as one
    file per seed."""
    if fmt is not None and fmt not in FORMATS:
        raise ItemsError(f"--format {fmt!r}: expected one of {sorted(FORMATS)}")
    if len(specs) > MAX_ARMS:
        raise ItemsError(f"--items: {len(specs)} arms, at most {MAX_ARMS}")
    arms: list[Arm] = []
    seen: dict[Path, str] = {}
    for spec in specs:
        name, paths = parse_arm(spec)
        if any(a.name == name for a in arms):
            raise ItemsError(f"--items: two arms are named {name!r}")
        arm = Arm(name)
        for p in paths:
            where = p.resolve()
            if where in seen:
                raise ItemsError(f"--items: {p} is given twice ({seen[where]} and {name}): a file compared "
                                 "with itself says nothing")
            seen[where] = name
            arm.files += read_items(p, fmt, metric)
        arms.append(arm)
    formats = {(f.format, f.metric) for a in arms for f in a.files}
    if len(formats) > 1:
        raise ItemsError("the files score different things: " + ", ".join(
            f"{a.name}: {f.path} ({f.format}, {f.metric})" for a in arms for f in a.files[:1])
            + " (pass --metric to name one metric every file has)")
    return arms


def match_items(arms: list[Arm]) -> tuple[list[str], list[str] | None]:
    """(the item ids in one order, each item's category or None): every file must hold the first file's item
    set, with the same category per item; refused with the counts and a few ids otherwise."""
    files = [(a, f) for a in arms for f in a.files]
    (ra, ref), others = files[0], files[1:]
    ref_ids = set(ref.ids)
    for arm, f in others:
        ids = set(f.ids)
        if ids != ref_ids:
            only_ref, only_f = sorted(ref_ids - ids), sorted(ids - ref_ids)
            raise ItemsError(
                f"item sets differ: {ra.name} ({ref.path}) has {len(ref_ids)} items, {arm.name} ({f.path}) "
                f"has {len(ids)}; {len(only_ref)} only in the first (e.g. {only_ref[:5]}), {len(only_f)} "
                f"only in the second (e.g. {only_f[:5]}): paired results need the same items in every file")
    # the item order is part of the bootstrap's draw: integer ids ascending, as compare orders a sweep's
    # item indices (a sweep read back from files gets the sweep's own numbers), other ids in the first
    # file's order
    order = (sorted(ref.ids, key=int) if all(i.isdigit() and (i == "0" or i[0] != "0") for i in ref.ids)
             else list(ref.ids))
    cats = [f.categories_by_id() for _, f in files]
    if all(c is None for c in cats):
        return order, None
    if any(c is None for c in cats):
        missing = [str(f.path) for (_, f), c in zip(files, cats) if c is None]
        raise ItemsError(f"some files carry item categories and some do not (none in {missing[:3]})")
    ref_cat = cats[0]
    for (arm, f), c in zip(others, cats[1:]):
        bad = [i for i in order if c[i] != ref_cat[i]]
        if bad:
            raise ItemsError(f"item categories differ: {len(bad)} item(s) of {arm.name} ({f.path}) have "
                             f"another category than in {ref.path}, e.g. {bad[0]!r}: {c[bad[0]]!r} vs "
                             f"{ref_cat[bad[0]]!r}")
    return order, [ref_cat[i] for i in order]


def pair_seeds(arms: list[Arm]) -> list[int]:
    """The seeds every arm has, and each arm's files put in that order: by the files' own `seed` values when
    every file has one, else by position (the first file of each arm is seed 0, and so on)."""
    given = [f.seed is not None for a in arms for f in a.files]
    if all(given):
        for a in arms:
            seeds = [f.seed for f in a.files]
            if len(set(seeds)) != len(seeds):
                twice = next(s for s in seeds if seeds.count(s) > 1)
                raise ItemsError(f"arm {a.name}: two files hold seed {twice}")
            a.files.sort(key=lambda f: f.seed)
        want = [f.seed for f in arms[0].files]
        for a in arms[1:]:
            have = [f.seed for f in a.files]
            if have != want:
                raise ItemsError(f"arm {a.name} has seeds {have}, arm {arms[0].name} {want}: a seed present "
                                 "in one arm only cannot be paired")
        return [int(s) for s in want]
    if any(given):
        raise ItemsError("some files name their seed (a `seed` column) and some do not: pairing by seed and "
                         "by position cannot be mixed")
    counts = {a.name: len(a.files) for a in arms}
    if len(set(counts.values())) != 1:
        raise ItemsError(f"the arms have different numbers of files {counts}: files are paired by position "
                         "(one per seed, in seed order), so every arm needs as many")
    return list(range(len(arms[0].files)))


# ----------------------------------------------------------------------------- the pre-registered rule
def load_plan(path: str | Path) -> dict[str, Any]:
    """The decision rule of a YAML file: the `decision` block's keys, at the top level or under
    `decision:`."""
    from trainer.config.schema import ConfigError, DecisionConfig

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ItemsError(f"--decision {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ItemsError(f"--decision {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(raw, dict) and set(raw) == {"decision"}:
        raw = raw["decision"]
    if not isinstance(raw, dict) or not raw:
        raise ItemsError(f"--decision {path}: expected a mapping of decision keys (method, alpha, ...)")
    known = set(DecisionConfig.__dataclass_fields__)
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ItemsError(f"--decision {path}: unknown key(s) {unknown}; the decision block's keys are "
                         f"{sorted(known)}")
    try:
        DecisionConfig(**raw)
    except (ConfigError, TypeError) as e:
        raise ItemsError(f"--decision {path}: decision.{e}") from None
    if raw.get("endpoint", "final") != "final":
        raise ItemsError(f"--decision {path}: endpoint {raw['endpoint']!r} needs eval curves; per-item files "
                         "hold one score per item (endpoint: final)")
    if raw.get("looks"):
        raise ItemsError(f"--decision {path}: looks {raw['looks']} are not supported for per-item files: the "
                         "looks ledger lives beside the training runs (eval.sequential), and files written "
                         "elsewhere do not say which looks came before; drop `looks` (one look at alpha)")
    return raw


def resolve_items_rule(plan_path: str | None, cli: dict[str, Any], override: bool, first_arm: str,
                       n_seeds: int, binary: bool = False) -> Rule:
    """The Rule of eval.comparison.resolve_rule, from a plan file (command-line changes to it need
    --override-decision) or, with no plan, from the command line alone (then nothing was pre-registered, and
    the rule says so)."""
    if cli.get("endpoint") not in (None, "final"):
        raise ItemsError("--endpoint: per-item files hold one score per item (endpoint final only)")
    if plan_path is not None:
        plan = dict(load_plan(plan_path))
        plan.setdefault("baseline", first_arm)
        source = f"pre-registered in {plan_path}"
        given = cli
    else:
        plan = {"baseline": first_arm, **{k: v for k, v in cli.items() if v is not None}}
        source = "the command line (no --decision plan: not pre-registered)"
        given, override = {}, False
    stub = Run(path=Path(plan_path or "."), config={"decision": plan}, info={}, loss="", seed=0,
                     eval_name="items")
    try:
        rule = resolve_rule([stub], given, override, n_seeds=n_seeds, binary=binary)
    except CompareError as e:
        msg = str(e).replace(f"run {stub.path}: decision config", f"--decision {plan_path}")
        raise ItemsError(msg) from None
    if rule.looks:  # with no plan file: the decision block's default has none, and no option sets it
        raise ItemsError("decision.looks: not supported for per-item files (no looks ledger)")
    rule.source = source
    return rule


# ----------------------------------------------------------------------------- the comparison
def compare_items(specs: list[str], fmt: str | None = None, metric: str | None = None,
                  plan: str | None = None, baseline: str | None = None, method: str | None = None,
                  alpha: float | None = None, margin: float | None = None,
                  equivalence_margin: float | None = None, override_decision: bool = False,
                  n_bootstrap: int | None = None, seed: int | None = None,
                  out: str | Path | None = None) -> dict[str, Any]:
    """Read, match and pair the arms' files, decide with the rule and methods a sweep gets
    (eval.comparison.score_rows) and write compare.json / compare.md (no plots: there are no training
    curves) into `out` (default: the files' common folder). Every check runs before anything is written."""
    n_bootstrap = DEFAULT_BOOTSTRAP if n_bootstrap is None else n_bootstrap
    seed = DEFAULT_BOOTSTRAP_SEED if seed is None else seed
    check_options(alpha, n_bootstrap, ItemsError)
    arms = load_arms(specs, fmt, metric)
    seeds = pair_seeds(arms)
    order, cats = match_items(arms)
    by_name = {a.name: a for a in arms}
    cli = {"method": method, "alpha": alpha, "margin": margin, "baseline": baseline,
           "equivalence_margin": equivalence_margin}
    # one run per arm on right / wrong scores: `auto` is the exact McNemar test (eval.stats.resolve_method)
    binary = all(np.isin(f.scores_in(order), (0.0, 1.0)).all() for a in arms for f in a.files)
    rule = resolve_items_rule(plan, cli, override_decision, arms[0].name, len(seeds), binary)
    moved = (n_bootstrap, seed) != (DEFAULT_BOOTSTRAP, DEFAULT_BOOTSTRAP_SEED)
    if moved and rule.method == "paired_bootstrap":
        if not override_decision:
            raise ItemsError(f"the bootstrap decides, and --bootstrap {n_bootstrap} / --seed {seed} are not "
                             f"its pre-registered {DEFAULT_BOOTSTRAP} resamples, seed "
                             f"{DEFAULT_BOOTSTRAP_SEED}; pass --override-decision to decide anyway (the report "
                             "says so)")
        rule.overridden.append(f"bootstrap: {DEFAULT_BOOTSTRAP} resamples, seed {DEFAULT_BOOTSTRAP_SEED} -> "
                               f"{n_bootstrap} resamples, seed {seed}")
    arms_SN = {a.name: np.stack([f.scores_in(order) for f in a.files]) for a in arms}
    labels = {a.name: [a.label(s) for s in seeds] for a in arms}
    first = arms[0].files[0]
    files = [f for a in arms for f in a.files]
    out_dir = Path(out).resolve() if out else Path(os.path.commonpath([str(f.path.resolve().parent)
                                                                       for f in files]))
    notes = [n for f in files for n in f.notes]
    notes = list(dict.fromkeys(notes))  # one note per distinct message
    notes.append("per-item files carry no training metrics: whether the arms' switch acted (`inert`) is not "
                 "checked, and the configs of the runs are not compared")
    item_sha = hashlib.sha256("\n".join(order).encode()).hexdigest()
    arm_rows = [_arm_row(a, f, s, rule.alpha, order, role="") for a in arms for f, s in zip(a.files, seeds)]
    common = {"source": "items", "format": first.format, "metric": first.metric, "eval_name": first.eval_name,
              "n_seeds": len(seeds), "seeds": seeds, "n_items": len(order),
              "config_diff": [], "ignored_config_keys": [], "item_set_sha256": item_sha,
              "inputs": [str(f.path) for f in files], "output_dir": str(out_dir), "plots": {}, "notes": notes,
              "alpha": rule.alpha, "method": rule.method, "decision_rule": rule.text()}
    common["decision"] = _rule_dict(rule)
    if len(arms) == 1:
        if len(seeds) < 2:
            raise ItemsError(f"one arm ({arms[0].name}) with one file: nothing to compare (two arms, or one "
                             "arm at >= 2 seeds for the between-seed spread)")
        spread = aa_spread({s: arms_SN[arms[0].name][i] for i, s in enumerate(seeds)}, rule.alpha)
        spread.update(sweep=None, loss=arms[0].name)
        for r in arm_rows:
            r["role"] = "A/A"
        result = {"mode": "aa", "verdict": None, "verdict_scope": "across_seeds", "baseline": arms[0].name,
                  "treatments": [], "aa": spread, "arms": arm_rows, **common}
        return _write(result, [], {}, out_dir, False, "")
    base = rule.baseline
    if base not in by_name:
        raise ItemsError(f"the baseline {base!r} (--baseline / decision.baseline) names no arm; the arms are "
                         f"{[a.name for a in arms]}")
    check_decider(rule, len(seeds), n_bootstrap,
                  f"each arm has {len(seeds)} file(s); give one file per seed "
                  f"(>= {METHODS[rule.method].min_seeds}) or decide with an item-level method "
                  "(--method paired_hoeffding)", ItemsError)
    treatments = [a.name for a in arms if a.name != base]
    try:
        rows, _ = score_rows(arms_SN, labels, base, treatments, seeds, rule, n_bootstrap, seed)
        categories = (category_rows(arms_SN, cats, base, treatments, rule, n_bootstrap, seed)
                      if cats is not None else None)
    except ValueError as e:  # CompareError included
        raise ItemsError(str(e)) from None
    notes += _rule_notes(rows, rule, len(seeds), None)
    for r in arm_rows:
        r["role"] = "baseline" if r["value"] == base else "treatment"
    result = {"mode": "ab", "switch": "arm", "treatments": treatments, "baseline": base,
              "verdict_scope": rule.scope, "verdict_about": SCOPE_TEXT[rule.scope], "comparisons": rows,
              "verdicts": [{k: r[k] for k in _VERDICT_KEYS} for r in rows], "curve": None, "aa": None,
              "arms": arm_rows, "categories": categories, **common}
    earlier_looks(result, None, plannable=False)
    if len(rows) == 1:
        result.update({k: v for k, v in rows[0].items() if k not in result or k in ("verdict", "method")},
                      treatment=treatments[0])
    return _write(result, [], {}, out_dir, False, f" ({', '.join(treatments)} vs {base})")


def _arm_row(arm: Arm, f: ItemFile, seed: int, alpha: float, order: list[str], role: str) -> dict[str, Any]:
    s_N = f.scores_in(order)
    n, total = len(order), float(s_N.sum())
    # a score in [0, 1] with mean p has variance <= p (1 - p), so the Wilson interval of round(sum) / n is a
    # (conservative) interval for the mean of fractional scores too
    lo, hi = wilson_interval(round(total), n, alpha)
    return {"arm": arm.label(seed), "role": role, "loss": arm.name, "value": arm.name, "seed": seed,
            "run": str(f.path), "job": None, "run_name": arm.name, "eval_file": str(f.path),
            "format": f.format, "metric": f.metric, "repeats": f.repeats, "endpoint_mean": total / n, "n": n,
            "accuracy": total / n, "wilson_low": lo, "wilson_high": hi}


def category_rows(arms_SN: dict[str, np.ndarray], cats: list[str], base: str,
                  treatments: list[str], rule: Rule, n_bootstrap: int, seed: int) -> dict[str, Any]:
    """Secondary results: the rule on each category's items, one row per (treatment, category), decided by
    Holm's step-down over all of those rows together (decide_all on the whole family), so that reading the
    best category out of many does not inflate the error rate. They decide nothing: the verdict is the one
    over all items."""
    names = sorted(set(cats))
    cats_N = np.asarray(cats)
    rows, helpers = [], []
    for t in treatments:
        for c in names:
            cols = np.flatnonzero(cats_N == c)
            t_SN, b_SN = arms_SN[t][:, cols], arms_SN[base][:, cols]
            item, methods, h = method_table(t_SN, b_SN, rule.alpha, rule.margin, n_bootstrap, seed)
            rows.append({"treatment": f"{t} [{c}]", "baseline": base, "arm": t, "category": c,
                         "n_items": int(cols.size), "diff": item["diff"], "methods": methods})
            helpers.append(h)
    decide_all(rows, helpers, rule)
    for r in rows:
        r.pop("methods")
    return {"names": names, "family_size": len(rows), "multiplicity": "Holm step-down over every (treatment, "
            "category) row", "rows": rows}


def items_summary(result: dict[str, Any], summary: Any) -> str:
    """compare's summary lines (`summary`), where the rule came from, then the per-category secondary
    results."""
    lines = [(f"items: {result['n_items']} ({result['format']} files, metric {result['metric']}) x "
              f"{result['n_seeds']} seed(s) per arm"), summary(result),
             f"rule source: {result['decision']['source']}"]
    cats = result.get("categories")
    if cats:
        lines.append(f"secondary, per category ({cats['multiplicity']}, {cats['family_size']} rows; they "
                     "decide nothing):")
        for r in cats["rows"]:
            iv = ("" if r["ci_low"] is None
                  else f", interval [{100 * r['ci_low']:+.2f}, {100 * r['ci_high']:+.2f}] pts")
            lines.append(f"  {r['arm']} vs {r['baseline']} [{r['category']}] ({r['n_items']} items): "
                         f"{100 * r['estimate']:+.2f} pts{iv}, Holm p {r['p_holm']:.4g}: {r['verdict']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- design from per-item files
def pilot_from_items(specs: list[str], fmt: str | None = None, metric: str | None = None,
                     baseline: str | None = None) -> dict[str, Any]:
    """The design's inputs from per-item files (`python -m eval.design --from ...`): items, seeds per arm, the
    share of items the arms disagree on (mean |T - B| per item, the discordance for 0/1 scores) and the
    between-seed sd of one arm's mean (one arm at >= 2 seeds: their sd; two arms at >= 2 seeds: the sd of
    the per-seed gaps / sqrt(2), as eval.design.pilot_estimates does for a sweep)."""
    specs = [s if "=" in s else f"arm{k}={s}" for k, s in enumerate(specs)]
    arms = load_arms(specs, fmt, metric)
    seeds = pair_seeds(arms)
    order, _ = match_items(arms)
    n = len(order)
    arms_SN = {a.name: np.stack([f.scores_in(order) for f in a.files]) for a in arms}
    binary = bool(all(np.isin(x, (0.0, 1.0)).all() for x in arms_SN.values()))  # auto's one-seed test
    f0 = arms[0].files[0]
    what = f"{len(arms)} arm(s) x {len(seeds)} seed(s) of {f0.format} files ({f0.metric})"
    if len(arms) == 1:
        s_SN = arms_SN[arms[0].name]
        if len(seeds) < 2:
            raise ItemsError("--from: one arm with one file; give two arms, or one arm at >= 2 seeds")
        S = len(seeds)
        disc = [float(np.abs(s_SN[i] - s_SN[j]).mean()) for i in range(S) for j in range(i + 1, S)]
        sd = float(np.std(s_SN.mean(axis=1), ddof=1))
        return {"n_items": n, "n_seeds": len(seeds), "discordance": max(float(np.mean(disc)), 1.0 / n),
                "seed_sd": sd, "source": f"A/A {what}", "binary": binary}
    base = baseline if baseline is not None else arms[0].name
    if base not in arms_SN:
        raise ItemsError(f"--from: the baseline {base!r} names no arm ({list(arms_SN)})")
    b_SN = arms_SN[base]
    disc, gaps = [], []
    for name, t_SN in arms_SN.items():
        if name != base:
            disc += [float(x) for x in np.abs(t_SN - b_SN).mean(axis=1)]
            gaps += [float(x) for x in (t_SN - b_SN).mean(axis=1)]
    sd = float(np.std(gaps, ddof=1) / np.sqrt(2)) if len(gaps) >= 2 else None
    return {"n_items": n, "n_seeds": len(seeds), "discordance": max(float(np.mean(disc)), 1.0 / n),
            "seed_sd": sd, "source": f"A/B {what}, baseline {base}", "binary": binary}
