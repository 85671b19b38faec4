"""The runs and arms of a comparison: finding and reading run folders, the checks that make them one paired
experiment (configs equal outside the arms' switch, the same items, one run per arm and seed), the switch
that tells the arms apart, and the notes on how the runs were made. Everything here reads files and raises
CompareError with the run and the problem; nothing is written."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eval.records import read_item_records
from trainer.config.ignored_keys import IGNORED_CONFIG_KEYS  # which keys may differ between arms, and why
from trainer.run_info import resolved_precision


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
    """Read the run's final eval file into run.records, unless records are there already (runs built in
    memory, e.g. from another harness's per-item files, carry their own)."""
    if run.records:
        return
    if not run.eval_file.is_file():
        eval_dir = run.path / "eval"
        have = sorted(p.name for p in eval_dir.glob("*.jsonl")) if eval_dir.is_dir() else []
        hint = f" (eval files present: {have})" if have else " (no eval/ files: did the run finish?)"
        raise CompareError(f"run {run.arm} ({run.path}): missing final eval file {run.eval_file}{hint}")
    run.records = read_item_records(run.eval_file)


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


def ignored_key(key: str, ignore: tuple[str, ...]) -> bool:
    """`key` (dotted) is one of the `ignore` prefixes or below one (`a.b` covers `a.b.*`)."""
    return any(key == p or key.startswith(p + ".") for p in ignore)


def config_differences(a: dict[str, Any], b: dict[str, Any],
                       ignore: tuple[str, ...] = IGNORED_CONFIG_KEYS) -> list[tuple[str, Any, Any]]:
    """(key, value in a, value in b) for each dotted key that differs and is not ignored."""
    fa, fb = flatten(a), flatten(b)
    missing = object()
    diffs = []
    for key in sorted(set(fa) | set(fb)):
        if ignored_key(key, ignore):
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
        r.switch_value = f"{switch}={value_text(flatten(r.config).get(switch))}"
    return switch


def value_text(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()


def arm_named(name: str, switch: str, arms: list[str]) -> str | None:
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


def final_step(run: Run) -> int:
    return int(((run.config.get("schedule") or {}).get("num_steps")) or 0)


def sweep_subsets(runs: list[Run], paths: list[Path]) -> list[str]:
    """The sweeps of which only some runs are here. A run's sweep is the folder its run_info.json `run_dir`
    names (where train.py wrote it), else its folder's real parent (symbolic links resolved): runs linked or
    copied into a new folder still name the sweep they came from. One line per such sweep, naming the runs
    left out.

    Runs that recorded their launch's membership (run_info.json `sweep`: every job's overrides and a hash,
    trainer.hydra_callbacks.SweepRecord) are checked against it, so a subset is named even when the
    sweep's folder is gone or renamed."""
    found, by_launch = [], {}
    for r in runs:
        m = r.info.get("sweep")
        if isinstance(m, dict) and isinstance(m.get("jobs"), list) and isinstance(m.get("job"), int):
            by_launch.setdefault(str(m.get("sha256")), (m, []))[1].append(r)
    for m, members in by_launch.values():
        have = {r.info["sweep"]["job"] for r in members}
        left = [j for j in range(len(m["jobs"])) if j not in have]
        if left:
            rd = members[0].info.get("run_dir")
            origin = Path(rd).parent if isinstance(rd, str) and rd else members[0].path.resolve().parent
            shown = "; ".join(f"job {j}: {' '.join(m['jobs'][j])}" for j in left[:6])
            shown += "; ..." if len(left) > 6 else ""
            found.append(f"inputs: {len(have)} of the {len(m['jobs'])} runs of the sweep {origin} "
                         f"(launched as {len(m['jobs'])} jobs, membership sha256 {str(m.get('sha256'))[:12]} "
                         "in each run's run_info.json: a subset, whatever folder they are in now; left out: "
                         f"{shown}; a job that failed counts as left out: rerun it)")
    listed = {id(r) for _, members in by_launch.values() for r in members}
    by_origin: dict[Path, set[str]] = {}
    for r in runs:
        if id(r) in listed:  # checked against its launch's own record above
            continue
        rd = r.info.get("run_dir")
        home = Path(rd) if isinstance(rd, str) and rd else r.path.resolve()
        by_origin.setdefault(home.parent, set()).add(home.name)
    for origin, have in sorted(by_origin.items()):
        if not origin.is_dir():
            continue
        members = {p.name for p in origin.iterdir()
                   if p.is_dir() and p.name.isdigit() and (p / "config.yaml").is_file()}
        left = sorted(members - have, key=int)
        if not left or not have <= members:
            continue
        if len(paths) == 2 and all(p.parent == origin for p in paths):
            found.append(f"inputs: two run folders of the sweep {origin}, which holds {len(members)} runs "
                         f"({', '.join(left)} left out)")
        else:
            found.append(f"inputs: {len(have)} of the {len(members)} runs of the sweep {origin} (a subset, "
                         f"whatever folder they are in now; {', '.join(left)} left out)")
    return found


def _is_sweep(path: Path) -> bool:
    return path.is_dir() and not (path / "config.yaml").is_file()


def load_inputs(paths: list[Path], eval_name: str | None, out: str | Path | None) -> tuple[list[Run], Path]:
    if len(paths) == 1:
        if (paths[0] / "config.yaml").is_file():
            raise CompareError(f"{paths[0]} is a single run folder; pass its sweep folder or two run folders")
        runs = [load_run(p, eval_name, job) for job, p in discover_runs(paths[0])]
        return runs, Path(out).resolve() if out else paths[0]
    if len(paths) >= 2 and all(_is_sweep(p) for p in paths):
        # the seeds of a later look, run as a new sweep beside the first: every run of each sweep is an
        # input (so none is a subset), labelled <sweep number>.<job> so job numbers stay unique
        if len(set(paths)) != len(paths):
            raise CompareError(f"a sweep folder is given twice: {[str(p) for p in paths]}")
        runs = [load_run(p, eval_name, f"{i}.{job}") for i, sweep in enumerate(paths)
                for job, p in discover_runs(sweep)]
        return runs, Path(out).resolve() if out else paths[-1]
    if len(paths) == 2:
        if paths[0] == paths[1]:
            raise CompareError(f"the two run folders are the same: {paths[0]}")
        runs = [load_run(p, eval_name) for p in paths]
        a, b = runs
        if a.seed != b.seed and (a.loss != b.loss or config_differences(a.config, b.config)):
            raise CompareError(f"the two runs have different seeds ({a.arm}: {a.path}, {b.arm}: {b.path}); "
                               "arms are paired within one seed")
        return runs, Path(out).resolve() if out else Path(os.path.commonpath([str(p) for p in paths]))
    raise CompareError(f"expected sweep folders or two run folders, got {len(paths)} paths of which "
                       f"{sum(not _is_sweep(p) for p in paths)} are run folders")


def run_notes(runs: list[Run]) -> list[str]:
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


# the fields of run_info.json's `engine` that are no implementation choice: the resolved dtypes (the
# precision, refused or noted on its own), the reasons given for `auto` and the training packing, and the
# sampler's mismatch knobs and draw (config values: the config diff names them)
_ENGINE_NOT_CHOICES = frozenset({"sampler_dtype", "train_dtype", "auto", "train_packing", "sampler_quant",
                                 "sampler_logit_noise", "sampling_coupling"})


def _engine_notes(runs: list[Run]) -> list[str]:
    """A note when the arms' engine plans (run_info.json `engine`) differ beyond the precision: which ops ran
    native, on the AMX tiles or on oneDNN-packed weights decides the summation order, so neither arm's bits
    are what the other arm's code path would give (`PAIREDRL_TORCH_OPS`, another CPU or torch build). Names
    the fields that every arm records (a run of an older build records fewer)."""
    engines = {r.arm: r.info.get("engine") if isinstance(r.info.get("engine"), dict) else {} for r in runs}
    shared = set.intersection(*(set(e) for e in engines.values())) - _ENGINE_NOT_CHOICES if engines else set()
    keys = sorted(k for k in shared if len({json.dumps(e[k], sort_keys=True) for e in engines.values()}) > 1)
    if not keys:
        return []
    return [f"the arms ran different engine plans (the ops' summation order differs, so one arm's numbers are not "
            f"what the other's plan would give): {', '.join(keys)}: "
            + "; ".join(f"{arm} {{{', '.join(f'{k}={e.get(k)}' for k in keys)}}}" for arm, e in engines.items())]


def _run_info_values(runs: list[Run], what: str) -> dict[str, str]:
    """{arm: value} of run_info.json's resolved `precision` (`trainer.run_info.resolved_precision`), `cpu`
    model or torch version."""
    def get(r: Run) -> Any:
        if what == "torch":
            return (r.info.get("versions") or {}).get("torch")
        if what == "precision":
            return resolved_precision(r.info)
        return r.info.get(what)
    return {r.arm: str(get(r)) for r in runs}


def check_precision(runs: list[Run], allow: bool) -> None:
    """Arms trained at different resolved precisions (backend dtype `auto` resolves per machine) are not one
    experiment: refused unless --allow-config-diff (then a note says so)."""
    seen = _run_info_values(runs, "precision")
    if len(set(seen.values())) > 1 and not allow:
        raise CompareError(f"the runs trained at different resolved precisions {seen} (run_info.json "
                           "`engine`; `precision` in runs of older builds): pin the backend dtypes, or pass "
                           "--allow-config-diff to compare anyway")


def mixed_loss_paths(runs: list[Run]) -> dict[str, str | None]:
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
