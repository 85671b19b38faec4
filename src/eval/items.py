"""The paired verdict on per-item results written anywhere: `python -m eval.compare --items
NAME=FILE[,FILE...] NAME=FILE[,FILE...] [--baseline NAME] [--format F] [--metric M] [--decision plan.yaml]`.

Each arm is one or more per-item result files (one per seed or checkpoint, in seed order), read by a format
adapter (eval/item_formats.py: lm-evaluation-harness `--log_samples`, the tinker-cookbook EvalStore,
prime-rl eval rollouts, verl validation dumps, plain JSONL/CSV). Items are matched by their id, never by
their position in a file (a content hash where the format has no id), and where the format records what an
id stands for (lm-eval's `doc_hash`, prime-rl's question and answer) that must agree in every file: every
file must hold the same item set, and an id seen twice in a file, an item missing from one file (a task
missing from one arm is named as such), a metric missing from a line or an empty file is refused with a
count, never dropped. The one exception is the frameworks' own: an item whose every sample errored has no
score (prime-rl leaves errored rollouts out of its accuracy) and is left out of every arm, with a note. The
scores then go through the same decision as a sweep (eval.comparison.decide, the
methods of eval.methods, sign_flip and equivalence included): one file per arm gives a verdict about these
checkpoints, several seeds per arm the seed-level rule (decision.method = auto), Holm over several
treatments. Planned sequential looks (decision.looks) are refused: their ledger lives beside the training
runs (eval.sequential), and files written elsewhere say nothing of where those ran or which looks came
before. The rule is pre-registered in a YAML of the `decision` block's keys
(`--decision plan.yaml`); without one the command line's options are the rule, and the report says that it
was not pre-registered. Items that carry a category (an lm-eval run's tasks, a `category` column) also get
each arm's accuracy per category and one secondary result per (treatment, category), Holm-adjusted over all
of them (they decide nothing). Every interval is cut to [-1, 1], the range of a difference of two scores in
[0, 1]. The default output folder (the files' common parent) is refused when it holds another comparison's
report.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from eval.comparison import (
    aa_spread,
    check_decider,
    check_options,
    decide,
    decide_all,
    earlier_looks,
    resolve_rule,
    rule_notes,
    write_comparison,
)
from eval.item_formats import FORMATS, ItemFile, ItemsError, read_items
from eval.methods import METHODS, PairedBootstrap, PairedHoeffding, descriptive_bootstraps, method_table
from eval.result import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_BOOTSTRAP_SEED,
    ITEMS_RULE_KEYS,
    Arms,
    CompareRequest,
    Comparison,
    Rule,
    clip_to_score_range,
)
from eval.runs import CompareError, Run
from eval.stats import wilson_interval

__all__ = ["Arm", "ItemsError", "compare_item_files", "compare_items", "item_arms", "load_arms", "load_plan",
           "match_items", "parse_arm"]

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
    check_same_scores(arms, metric)
    return arms


def _family(fmt: str) -> str:
    return "plain" if fmt in ("jsonl", "csv") else fmt


def check_same_scores(arms: list[Arm], metric: str | None) -> None:
    """Every file of one framework, and each task (or the whole file) scored by one metric in every arm."""
    files = [(a, f) for a in arms for f in a.files]
    by_fmt: dict[str, list[tuple[Arm, ItemFile]]] = {}
    for a, f in files:
        by_fmt.setdefault(_family(f.format), []).append((a, f))
    if len(by_fmt) > 1:
        raise ItemsError("the arms' files come from different frameworks: " + "; ".join(
            f"{fmt}: {len(v)} file(s), e.g. {v[0][0].name}: {v[0][1].path}" for fmt, v in by_fmt.items())
            + ": their scores mean different things; compare files written by one framework")
    seen: dict[str, dict[str, tuple[Arm, ItemFile]]] = {}
    for a, f in files:
        for cat, m in (f.metrics_by_category or {"": f.metric}).items():
            seen.setdefault(cat, {}).setdefault(m, (a, f))
    for cat, found in seen.items():
        if len(found) < 2:
            continue
        kind = files[0][1].category_kind
        listed = "; ".join(f"{m} in {a.name}: {f.path}" for m, (a, f) in found.items())
        advice = ("--metric resolved to another filter in some files: name the filter too, "
                  f"--metric {metric.partition(',')[0]},<filter>" if metric
                  else "pass --metric to name one metric every file has")
        raise ItemsError(f"the files score different metrics{f' for {kind} {cat}' if cat else ''} ({listed}): "
                         + advice)


def _full(f: ItemFile) -> set[str]:
    return set(f.ids) | set(f.left_out)


_ID_KEY = {"lm_eval": "doc_id", "prime_rl": "example_id", "tinker_cookbook": "example_id", "verl": "prompt"}


def _name_item(f: ItemFile, item: str, cats: dict[str, str] | None) -> str:
    """`doc_id 3 of task arith_add`: an item as its file names it."""
    key = _ID_KEY.get(f.format, "item_id")
    cat = cats.get(item) if cats else None
    if cat is not None and item.startswith(f"{cat}/"):
        return f"{key} {item[len(cat) + 1:]} of {f.category_kind} {cat}"
    return f"{key} {item} of {f.category_kind} {f.eval_name}"


def match_items(arms: list[Arm], notes: list[str] | None = None) -> tuple[list[str], list[str] | None]:
    """(the item ids in one order, each item's category or None): every file must hold the first file's item
    set, with the same category and (where the format records one) the same content per item; refused with
    the counts and a few ids otherwise. Items a file holds without a score (every sample errored) are left
    out of every arm; `notes` gets a line saying how many."""
    files = [(a, f) for a in arms for f in a.files]
    (ra, ref), others = files[0], files[1:]
    cats = [f.categories_by_id() for _, f in files]
    if any(c is None for c in cats) and not all(c is None for c in cats):
        with_c = [f"{a.name}: {f.path}" for (a, f), c in zip(files, cats) if c is not None]
        without = [f"{a.name}: {f.path}" for (a, f), c in zip(files, cats) if c is None]
        raise ItemsError(f"some files are a run's folder (items named <task>/<id>: {with_c[:2]}) and some a "
                         f"single file ({without[:2]}): give every arm the same way, each a run's folder or "
                         "each its files")
    ref_ids = _full(ref)
    for (arm, f), c in zip(others, cats[1:]):
        ids = _full(f)
        if ids == ref_ids:
            continue
        if c is not None:
            have_ref, have = set(cats[0].values()), set(c.values())
            if have_ref != have:
                kind = ref.category_kind
                parts = []
                if have_ref - have:
                    parts.append(f"{arm.name} ({f.path}) lacks {kind}(s) {sorted(have_ref - have)} that "
                                 f"{ra.name} ({ref.path}) has")
                if have - have_ref:
                    parts.append(f"{arm.name} ({f.path}) has {kind}(s) {sorted(have - have_ref)} that "
                                 f"{ra.name} ({ref.path}) lacks")
                raise ItemsError("; ".join(parts) + f": every file needs the same {kind}s (run the missing "
                                 f"{kind}s, or compare the {kind}s every arm has by naming their files)")
        only_ref, only_f = sorted(ref_ids - ids), sorted(ids - ref_ids)
        raise ItemsError(
            f"item sets differ: {ra.name} ({ref.path}) has {len(ref_ids)} items, {arm.name} ({f.path}) "
            f"has {len(ids)}; {len(only_ref)} only in the first (e.g. {only_ref[:5]}), {len(only_f)} "
            f"only in the second (e.g. {only_f[:5]}): paired results need the same items in every file")
    dropped = {i for _, f in files for i in f.left_out}
    kept = [i for i in ref.ids if i not in dropped]
    if not kept:
        raise ItemsError(f"no item has a score in every file: every sample of each ended in an error in some "
                         f"file ({len(dropped)} items)")
    if dropped and notes is not None:
        notes.append(f"{len(dropped)} item(s) left out of every arm, since every sample of theirs ended in an "
                     f"error in some file (as the framework's own accuracy leaves them out), e.g. "
                     f"{sorted(dropped)[:3]}")
    # the item order is part of the bootstrap's draw: integer ids ascending, as compare orders a sweep's
    # item indices (a sweep read back from files gets the sweep's own numbers), other ids in the first
    # file's order
    order = (sorted(kept, key=int) if all(i.isdigit() and (i == "0" or i[0] != "0") for i in kept)
             else kept)
    _check_content(files, order, cats[0])
    if all(c is None for c in cats):
        return order, None
    ref_cat = cats[0]
    for (arm, f), c in zip(others, cats[1:]):
        bad = [i for i in order if c[i] != ref_cat[i]]
        if bad:
            raise ItemsError(f"item categories differ: {len(bad)} item(s) of {arm.name} ({f.path}) have "
                             f"another category than in {ref.path}, e.g. {bad[0]!r}: {c[bad[0]]!r} vs "
                             f"{ref_cat[bad[0]]!r}")
    return order, [ref_cat[i] for i in order]


def _check_content(files: list[tuple[Arm, ItemFile]], order: list[str], cats: dict[str, str] | None) -> None:
    """The same id must name the same item in every file: lm-eval's `doc_id` and prime-rl's `example_id` are
    positions in the dataset, so another dataset revision, task file or selection puts another item behind
    an id; the format's content field (doc_hash, the question and answer) tells."""
    known = [(a, f, f.content_by_id()) for a, f in files if f.content is not None]
    if len(known) < 2:
        return
    ra, ref, rc = known[0]
    for arm, f, c in known[1:]:
        bad = [i for i in order if rc[i] and c[i] and rc[i] != c[i]]
        if bad:
            advice = ("" if f.format == "lm_eval" else
                      "; if the arms asked each question in other words on purpose, write both as plain files "
                      "(item_id, score) to pair them by id alone")
            raise ItemsError(f"{_name_item(f, bad[0], cats)} is another item in {arm.name} ({f.path}) than in "
                             f"{ra.name} ({ref.path}): its {f.content_key} differs ({len(bad)} of {len(order)} "
                             "items do); the runs did not score the same data (another dataset revision, task "
                             f"file or selection): compare runs on the same items{advice}")


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
    """compare.json's dict of compare_item_files (the python API, keyword for keyword the command line's)."""
    req = CompareRequest(fmt=fmt, metric=metric, plan=plan, baseline=baseline, method=method, alpha=alpha,
                         margin=margin, equivalence_margin=equivalence_margin,
                         override_decision=override_decision, out=out, make_plots=False)
    req.n_bootstrap = n_bootstrap
    if seed is not None:
        req.seed = seed
    return compare_item_files(specs, req).to_json()


def item_arms(specs: list[str], req: CompareRequest) -> tuple[list[Arm], Arms, Rule]:
    """The per-item files source: each arm's files read, matched and paired by item (Arms, with the notes
    the formats and the matching left), and the rule (a plan file, or the command line's options)."""
    arms = load_arms(specs, req.fmt, req.metric)
    seeds = pair_seeds(arms)
    match_notes: list[str] = []
    order, cats = match_items(arms, match_notes)
    # one run per arm on right / wrong scores: `auto` is the exact McNemar test (eval.methods.resolve_method)
    binary = all(np.isin(f.scores_in(order), (0.0, 1.0)).all() for a in arms for f in a.files)
    rule = resolve_items_rule(req.plan, req.rule_options(*ITEMS_RULE_KEYS), req.override_decision,
                              arms[0].name, len(seeds), binary)
    files = [f for a in arms for f in a.files]
    notes = list(dict.fromkeys([n for f in files for n in f.notes] + match_notes))  # one note per message
    notes.append("per-item files carry no training metrics: whether the arms' switch acted (`inert`) is not "
                 "checked, and the configs of the runs are not compared")
    base = rule.baseline
    by_name = {a.name: a for a in arms}
    if len(arms) > 1 and base not in by_name:
        raise ItemsError(f"the baseline {base!r} (--baseline / decision.baseline) names no arm; the arms are "
                         f"{[a.name for a in arms]}")
    typed = Arms(baseline=base if len(arms) > 1 else arms[0].name,
                 treatments=[a.name for a in arms if a.name != base] if len(arms) > 1 else [],
                 scores_SN={a.name: np.stack([f.scores_in(order) for f in a.files]) for a in arms},
                 labels={a.name: [a.label(s) for s in seeds] for a in arms}, seeds=seeds, item_order=order,
                 item_sha256=hashlib.sha256("\n".join(order).encode()).hexdigest(), notes=notes,
                 categories=cats)
    return arms, typed, rule


def compare_item_files(specs: list[str], request: CompareRequest | None = None) -> Comparison:
    """Read, match and pair the arms' files (item_arms), decide with the rule and methods a sweep gets
    (eval.comparison.decide) and write compare.json / compare.md (no plots: there are no training curves)
    into request.out (default: the files' common folder). Every check runs before anything is written."""
    req = request or CompareRequest(make_plots=False)
    check_options(req.alpha, req.n_bootstrap, ItemsError)
    file_arms, arms, rule = item_arms(specs, req)
    n_bootstrap, seed = req.resamples, req.seed
    moved = (n_bootstrap, seed) != (DEFAULT_BOOTSTRAP, DEFAULT_BOOTSTRAP_SEED)
    if moved and rule.method == PairedBootstrap.name:
        if not req.override_decision:
            raise ItemsError(f"the bootstrap decides, and --bootstrap {n_bootstrap} / --seed {seed} are not "
                             f"its pre-registered {DEFAULT_BOOTSTRAP} resamples, seed "
                             f"{DEFAULT_BOOTSTRAP_SEED}; pass --override-decision to decide anyway (the report "
                             "says so)")
        rule.overridden.append(f"bootstrap: {DEFAULT_BOOTSTRAP} resamples, seed {DEFAULT_BOOTSTRAP_SEED} -> "
                               f"{n_bootstrap} resamples, seed {seed}")
    cats = arms.categories
    task_cats = cats if cats is not None and len(set(cats)) > 1 else None  # one task: the verdict's own rows
    first = file_arms[0].files[0]
    files = [f for a in file_arms for f in a.files]
    if req.out:
        out_dir = Path(req.out).resolve()
    else:
        out_dir = Path(os.path.commonpath([str(f.path.resolve().parent) for f in files]))
        _refuse_another_comparison(out_dir, arms.item_sha256, [a.name for a in file_arms], first)
    notes = arms.notes
    seeds, order = arms.seeds, arms.item_order
    arm_rows = [_arm_row(a, f, s, rule.alpha, order, role="")
                for a in file_arms for f, s in zip(a.files, seeds)]
    common: dict[str, Any] = {"source": "items", "rule": rule, "arms": arms, "arm_rows": arm_rows,
                              "notes": notes, "inputs": [str(f.path) for f in files], "output_dir": out_dir,
                              "eval_name": first.eval_name, "fmt": first.format, "metric": first.metric}
    if len(file_arms) == 1:
        if len(seeds) < 2:
            raise ItemsError(f"one arm ({file_arms[0].name}) with one file: nothing to compare (two arms, or "
                             "one arm at >= 2 seeds for the between-seed spread)")
        spread = aa_spread({s: arms.scores_SN[arms.baseline][i] for i, s in enumerate(seeds)}, rule.alpha)
        spread.update(sweep=None, loss=arms.baseline)
        for r in arm_rows:
            r["role"] = "A/A"
        return write_comparison(Comparison(mode="aa", rows=[], aa=spread, **common), [], {}, False, "")
    check_decider(rule, len(seeds), n_bootstrap,
                  f"each arm has {len(seeds)} file(s); give one file per seed "
                  f"(>= {METHODS[rule.method].min_seeds}) or decide with an item-level method "
                  f"(--method {PairedHoeffding.name})", ItemsError)
    base, treatments = arms.baseline, arms.treatments
    try:
        rows = decide(arms, rule, req)
        # the secondary rows decide nothing: a bootstrap runs there only as the rule, or when asked for
        skip = descriptive_bootstraps(rule.method) if req.n_bootstrap is None else frozenset()
        categories = (category_rows(arms.scores_SN, task_cats, base, treatments, rule, n_bootstrap, seed,
                                    skip) if task_cats is not None else None)
    except ValueError as e:  # CompareError included
        raise ItemsError(str(e)) from None
    if categories is not None:
        categories["kind"] = first.category_kind
        categories["accuracy"] = category_accuracy(file_arms, arms.scores_SN, task_cats, seeds)
    if clip_to_score_range([rows, categories]):
        notes.append("intervals are cut to [-100, +100] pts, the range of a difference of two scores in [0, 1] "
                     "(the methods' own bounds reach beyond it at few items or seeds)")
    notes += rule_notes(rows, rule, len(seeds), None)
    for r in arm_rows:
        r["role"] = "baseline" if r["value"] == base else "treatment"
    c = Comparison(mode="ab", rows=rows, switch="arm", categories=categories, **common)
    earlier_looks(c, None, plannable=False)
    return write_comparison(c, [], {}, False, f" ({', '.join(treatments)} vs {base})")


def _refuse_another_comparison(out_dir: Path, item_sha: str, arms: list[str], first: ItemFile) -> None:
    """The default output folder (the files' common parent) may already hold the report of another
    comparison (another task's files, other arms): refused before anything is written, rather than
    overwritten. The same comparison at other seeds is a later look and writes over it, as for a sweep."""
    prev_file = out_dir / "compare.json"
    if not prev_file.is_file():
        return
    try:
        prev = json.loads(prev_file.read_text())
    except (OSError, ValueError):
        prev = None
    same = (isinstance(prev, dict) and prev.get("source") == "items" and prev.get("item_set_sha256") == item_sha
            and prev.get("metric") == first.metric and prev.get("eval_name") == first.eval_name
            and sorted({a.get("loss") for a in prev.get("arms") or [] if isinstance(a, dict)}) == sorted(arms))
    if not same:
        if not isinstance(prev, dict):
            what = "a report this command cannot read"
        elif prev.get("source") == "items":
            old = sorted({str(a.get("loss")) for a in prev.get("arms") or [] if isinstance(a, dict)})
            what = f"per-item files of {prev.get('eval_name')!r}, arms {old}"
        else:
            what = "a sweep's"
        raise ItemsError(f"{prev_file} holds another comparison ({what}); pass --out DIR to write this one "
                         "elsewhere (nothing was written)")


def category_accuracy(arms: list[Arm], arms_SN: dict[str, np.ndarray], cats: list[str],
                      seeds: list[int]) -> list[dict[str, Any]]:
    """Each arm's accuracy per category (an lm-eval task: the number its results_*.json shows for it), over
    the category's items, per seed and averaged over seeds."""
    cats_N = np.asarray(cats)
    out = []
    for a in arms:
        by_cat = a.files[0].metrics_by_category or {}
        for c in sorted(set(cats)):
            cols = np.flatnonzero(cats_N == c)
            per_seed = arms_SN[a.name][:, cols].mean(axis=1)
            out.append({"arm": a.name, "category": c, "metric": by_cat.get(c, a.files[0].metric),
                        "n_items": int(cols.size), "accuracy": float(per_seed.mean()),
                        "accuracy_per_seed": dict(zip(map(str, seeds), map(float, per_seed)))})
    return out


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
                  treatments: list[str], rule: Rule, n_bootstrap: int, seed: int,
                  skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Secondary results: the rule on each category's items, one row per (treatment, category), decided by
    Holm's step-down over all of those rows together (decide_all on the whole family), so that reading the
    best category out of many does not inflate the error rate. They decide nothing: the verdict is the one
    over all items."""
    names = sorted(set(cats))
    cats_N = np.asarray(cats)
    rows, methods_K, samples = [], [], []
    for t in treatments:
        for c in names:
            cols = np.flatnonzero(cats_N == c)
            t_SN, b_SN = arms_SN[t][:, cols], arms_SN[base][:, cols]
            item, methods, sample = method_table(t_SN, b_SN, rule.alpha, rule.margin, n_bootstrap, seed, skip)
            rows.append({"treatment": f"{t} [{c}]", "baseline": base, "arm": t, "category": c,
                         "n_items": int(cols.size), "diff": item["diff"]})
            methods_K.append(methods)
            samples.append(sample)
    decisions = decide_all(methods_K, samples, [(r["treatment"], r["baseline"]) for r in rows], rule)
    for r, d in zip(rows, decisions):
        r.update(d.to_json())
    return {"names": names, "family_size": len(rows), "multiplicity": "Holm step-down over every (treatment, "
            "category) row", "rows": rows}


def items_summary(c: Comparison, summary: Any) -> str:
    """compare's summary lines (`summary`), where the rule came from, then the per-category secondary
    results."""
    lines = [(f"items: {c.n_items} ({c.fmt} files, metric {c.metric}) x {c.n_seeds} seed(s) per arm"),
             summary(c), f"rule source: {c.rule.source}"]
    cats = c.categories
    if cats and cats.get("accuracy"):
        by: dict[str, list[str]] = {}
        for r in cats["accuracy"]:
            by.setdefault(f"{r['category']} ({r['metric']})", []).append(f"{r['arm']} {r['accuracy']:.4f}")
        lines.append(f"accuracy per {cats.get('kind', 'category')}: "
                     + "; ".join(f"{k}: {', '.join(v)}" for k, v in by.items()))
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
