"""Format adapters: per-item result files of other frameworks -> one score in [0, 1] per item id.

Each adapter reads one file (or one run's folder of files, one per task/benchmark/env, whose name then becomes
the items' category and a prefix of their ids) and returns ItemFile objects. The formats, each read from the
writer's own source at the version named:

- `lm_eval`: lm-evaluation-harness 0.4.13 `--log_samples`, `samples_<task>_<date>.jsonl`
  (lm_eval/evaluator.py `evaluate`, the `example` dict: `doc_id`, `doc`, `target`, `arguments`, `resps`,
  `filtered_resps`, `filter`, `metrics` (the names), `doc_hash`, `prompt_hash`, `target_hash`, then one key
  per metric; lm_eval/loggers/evaluation_tracker.py `save_results_samples` writes one JSON line per sample and
  filter). The item id is `doc_id`; `--metric acc` or `acc,<filter>`; the default is the first metric of the
  file's first filter. A run's output folder gives one category per task (a group's subtasks).
- `tinker_cookbook`: tinker-cookbook 0.5.8 EvalStore, `runs/<run_id>/<benchmark>/trajectories.jsonl`
  (tinker_cookbook/eval/benchmarks/_types.py `StoredTrajectory.to_dict`: `idx`, `benchmark`, `example_id`,
  `turns`, `reward`, `metrics`, `logs`, `error`, `time_seconds`; written by `_runner.py` `_save_trajectory`).
  The id is `example_id` (the runner's fallback is `str(idx)`); the default score is `reward > 0`, the
  runner's own accuracy (`BenchmarkBuilder.aggregate`); `--metric reward` or a key of `metrics`.
- `prime_rl`: prime-rl v0.6.0 eval rollouts, `rollouts/step_<n>/eval_rollouts_<env>.jsonl` (and
  `eval_rollouts.jsonl`, PR #2248) (src/prime_rl/orchestrator/orchestrator.py `finalize_eval_batch`,
  utils.py `save_rollouts`: orjson lines of `FinishedRollout.to_dict()` without `trajectory`; the fields are
  verifiers@78c1b3c `state_to_output`: `example_id`, `prompt`, `completion`, `answer`, `info`, `reward`,
  `error`, `timing`, `is_completed`, `is_truncated`, `stop_condition`, `metrics`, plus `env_name`,
  `group_id`, `policy_version`, `off_policy_steps`, `rollout_id`, `eval_step`). The id is `example_id`; the
  default score is `reward`, or a key of `metrics`.
- `verl`: verl v0.9.0 validation dump, `<trainer.validation_data_dir>/<global_step>.jsonl`
  (verl/trainer/ppo/ray_trainer.py `_validate` -> `_write_generations`: `input`, `output`, `gts`, `score`,
  `step`, then each reward-extra-info list, e.g. `reward`, `acc`). The dump has no id: the item id is the
  sha256 of the decoded prompt `input`; the default score is `score`, or another key of the line.
- `jsonl` / `csv`: this project's plain format: `item_id` (string or integer), `score` in [0, 1] or
  `correct` (true/false, 1/0), optional `seed` (integer; one file may then hold several seeds) and
  `category`.

Several samples of one item (prime-rl `group_size`, the cookbook's pass@k `num_samples`, verl's
`val_kwargs.n`) are averaged into the item's score, and every item must have as many (a note says how
many); in the lm-eval and plain formats an id seen twice is refused. Every score must be a finite number in
[0, 1]: rewards on another scale are refused rather than rescaled.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAX_LINES_PER_FILE = 20_000_000
MAX_LINE_CHARS = 64 * 1024 * 1024


class ItemsError(ValueError):
    """Per-item files that cannot be compared; the message names the file (and line) and the problem."""


@dataclass
class ItemFile:
    """One seed's (or checkpoint's) per-item scores."""

    path: Path
    format: str
    metric: str  # what the score is, e.g. `acc,none`, `reward`, `score`
    eval_name: str  # the task / benchmark / env, for the report
    ids: list[str]
    scores_N: np.ndarray  # float64 in [0, 1], in `ids` order
    categories: list[str] | None = None
    seed: int | None = None
    repeats: int = 1  # samples averaged into each item's score
    notes: list[str] = field(default_factory=list)

    def scores_in(self, order: list[str]) -> np.ndarray:
        if self.ids == order:
            return self.scores_N
        pos = {i: k for k, i in enumerate(self.ids)}
        return self.scores_N[np.fromiter((pos[i] for i in order), dtype=np.int64, count=len(order))]

    def categories_by_id(self) -> dict[str, str] | None:
        return None if self.categories is None else dict(zip(self.ids, self.categories))


# ----------------------------------------------------------------------------- reading helpers
def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, JSON object) of each non-blank line; errors name the file and line."""
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise ItemsError(f"{path}: cannot read: {e.strerror or e}") from None
    n = 0
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if len(line) > MAX_LINE_CHARS:
                raise ItemsError(f"{path}:{lineno}: line longer than {MAX_LINE_CHARS} characters")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ItemsError(f"{path}:{lineno}: not valid JSON ({e.msg}); truncated or corrupted "
                                 "file?") from None
            if not isinstance(obj, dict):
                raise ItemsError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            n += 1
            if n > MAX_LINES_PER_FILE:
                raise ItemsError(f"{path}: more than {MAX_LINES_PER_FILE} lines")
            yield lineno, obj


def _score(value: Any, what: str, where: str) -> float:
    """A per-item score: a bool (1/0) or a finite number in [0, 1]."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        x = float(value)
        if math.isfinite(x) and 0.0 <= x <= 1.0:
            return x
    if isinstance(value, (list, dict)):
        raise ItemsError(f"{where}: {what} is {type(value).__name__}, not a per-item score (a corpus-level "
                         "metric such as bleu keeps its inputs per item, not a score): pick a per-item "
                         "metric with --metric")
    raise ItemsError(f"{where}: {what} = {value!r} is not a score in [0, 1] (a finite number or "
                     "true/false); rewards on another scale are refused, not rescaled")


def _collect(path: Path, fmt: str, metric: str, eval_name: str, rows: list[tuple[str, float, int]],
             repeats_ok: bool, notes: list[str] | None = None) -> ItemFile:
    """ItemFile from (id, score, line) rows: duplicates refused, or (repeats_ok) averaged at an equal
    count."""
    if not rows:
        raise ItemsError(f"{path}: no items (an empty file, or no line for {metric})")
    notes = list(notes or [])
    first: dict[str, int] = {}
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    dups: list[tuple[str, int]] = []
    for item, score, lineno in rows:
        if item in first:
            dups.append((item, lineno))
            sums[item] += score
            counts[item] += 1
        else:
            first[item], sums[item], counts[item] = lineno, score, 1
    if dups and not repeats_ok:
        item, lineno = dups[0]
        raise ItemsError(f"{path}:{lineno}: duplicate item id {item!r} (first on line {first[item]}); "
                         f"{len(dups)} line(s) repeat an id of {len(first)} items: an id must name one item")
    ids = list(first)
    k = set(counts.values())
    if len(k) > 1:
        few = min(ids, key=lambda i: counts[i])
        raise ItemsError(f"{path}: items have different numbers of samples ({sorted(k)}; e.g. {few!r} "
                         f"has {counts[few]}): an item's score is the mean of its samples, so every item "
                         "needs as many")
    repeats = k.pop()
    if repeats > 1:
        notes.append(f"{fmt} files hold {repeats} samples per item: each item's score is their mean")
    scores = np.fromiter((sums[i] / repeats for i in ids), dtype=np.float64, count=len(ids))
    return ItemFile(path=path, format=fmt, metric=metric, eval_name=eval_name, ids=ids, scores_N=scores,
                    repeats=repeats, notes=notes)


def _metric_score(obj: dict[str, Any], metric: str, where: str, what: str) -> float:
    """A named entry of a record's `metrics` (cookbook trajectories and prime-rl rollouts both keep them
    beside `reward`), checked like any score; a missing one names those the record has."""
    ms = obj.get("metrics") or {}
    if metric not in ms:
        raise ItemsError(f"{where}: no metric {metric!r} (this {what} has reward and metrics {sorted(ms)})")
    return _score(ms[metric], f"metric {metric!r}", where)


def _item_id(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ItemsError(f"{where}: `{key}` must be a non-empty string or an integer, got {value!r}")
    return str(value)


# ----------------------------------------------------------------------------- the adapters
def read_lm_eval(path: Path, metric: str | None) -> ItemFile:
    want_metric, _, want_filter = (metric or "").partition(",")
    by_filter: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for lineno, obj in _lines(path):
        for key in ("doc_id", "filter", "metrics"):
            if key not in obj:
                raise ItemsError(f"{path}:{lineno}: no `{key}` (not an lm-evaluation-harness --log_samples "
                                 "line?)")
        by_filter.setdefault(str(obj["filter"]), []).append((lineno, obj))
    if not by_filter:
        raise ItemsError(f"{path}: no items (an empty file)")
    filters = list(by_filter)
    notes = []
    if want_filter:
        if want_filter not in by_filter:
            raise ItemsError(f"{path}: no filter {want_filter!r} (the file has {filters})")
        flt = want_filter
    else:
        flt = filters[0]
        if len(filters) > 1:
            notes.append(f"lm-eval filter {flt!r} of {filters} (name another as --metric <metric>,<filter>)")
    lines = by_filter[flt]
    name = want_metric or (lines[0][1]["metrics"] or [None])[0]
    if not name:
        raise ItemsError(f"{path}:{lines[0][0]}: the sample lists no metrics; name one with --metric")
    rows = []
    for lineno, obj in lines:
        where = f"{path}:{lineno}"
        if name not in obj:
            raise ItemsError(f"{where}: no metric {name!r} (this sample has {obj.get('metrics')}); name one "
                             "with --metric")
        item = _item_id(obj["doc_id"], where, "doc_id")
        rows.append((item, _score(obj[name], f"metric {name!r}", where), lineno))
    task = _LM_EVAL_FILE.match(path.name)
    eval_name = task.group(1) if task else path.stem
    return _collect(path, "lm_eval", f"{name},{flt}", eval_name, rows, False, notes)


def read_tinker_cookbook(path: Path, metric: str | None) -> ItemFile:
    rows = []
    benchmarks: set[str] = set()
    positional = False
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        if "idx" not in obj or "reward" not in obj:
            raise ItemsError(f"{where}: no `idx`/`reward` (not a tinker-cookbook trajectories.jsonl line?)")
        item = obj.get("example_id") or obj["idx"]
        positional |= not obj.get("example_id")
        benchmarks.add(str(obj.get("benchmark", "")))
        if metric in (None, "reward>0"):
            r = obj["reward"]
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise ItemsError(f"{where}: reward = {r!r} is not a finite number")
            score = 1.0 if r > 0 else 0.0
        elif metric == "reward":
            score = _score(obj["reward"], "reward", where)
        else:
            score = _metric_score(obj, metric, where, "trajectory")
        rows.append((_item_id(item, where, "example_id"), score, lineno))
    notes = (["tinker-cookbook items without an example_id are matched by their position (idx)"]
             if positional else [])
    name = ",".join(sorted(benchmarks)) or path.parent.name
    return _collect(path, "tinker_cookbook", metric or "reward>0", name, rows, True, notes)


def read_prime_rl(path: Path, metric: str | None) -> ItemFile:
    rows = []
    errors = 0
    envs: set[str] = set()
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        if "example_id" not in obj or "reward" not in obj:
            raise ItemsError(f"{where}: no `example_id`/`reward` (not a prime-rl eval rollouts line?)")
        errors += obj.get("error") is not None
        envs.add(str(obj.get("env_name", "")))
        if metric in (None, "reward"):
            score = _score(obj["reward"], "reward", where)
        else:
            score = _metric_score(obj, metric, where, "rollout")
        rows.append((_item_id(obj["example_id"], where, "example_id"), score, lineno))
    notes = ([f"{path}: {errors} rollout(s) ended in an error; they count with the reward prime-rl gave them"]
             if errors else [])
    name = ",".join(sorted(e for e in envs if e)) or path.stem
    return _collect(path, "prime_rl", metric or "reward", name, rows, True, notes)


def read_verl(path: Path, metric: str | None) -> ItemFile:
    rows = []
    name = metric or "score"
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        if "input" not in obj or "score" not in obj:
            raise ItemsError(f"{where}: no `input`/`score` (not a verl validation dump line?)")
        if not isinstance(obj["input"], str):
            raise ItemsError(f"{where}: `input` must be the prompt text, got {type(obj['input']).__name__}")
        if name not in obj:
            raise ItemsError(f"{where}: no key {name!r} (this line has {sorted(obj)})")
        item = hashlib.sha256(obj["input"].encode()).hexdigest()
        rows.append((item, _score(obj[name], f"{name!r}", where), lineno))
    return _collect(path, "verl", name, f"verl step {path.stem}", rows, True,
                    ["verl dumps carry no item id: items are matched by the sha256 of their prompt text"])


_CORRECT_TEXT = {"true": True, "false": False, "1": True, "0": False}


def _plain_rows(path: Path, records: Iterator[tuple[int, dict[str, Any]]], metric: str | None,
                text: bool) -> list[ItemFile]:
    per_seed: dict[int | None, list[tuple[str, float, int]]] = {}
    cats: dict[int | None, dict[str, str]] = {}
    has_cat: set[bool] = set()
    name = metric
    fmt = "csv" if text else "jsonl"
    for lineno, rec in records:
        where = f"{path}:{lineno}"
        if "item_id" not in rec:
            raise ItemsError(f"{where}: no `item_id` (the plain format: item_id, score or correct, optional "
                             "seed, category)")
        if name is None:
            name = "score" if "score" in rec else "correct" if "correct" in rec else None
            if name is None:
                raise ItemsError(f"{where}: no `score` or `correct` (name another column with --metric)")
        if name not in rec or rec[name] in (None, ""):
            raise ItemsError(f"{where}: no {name!r} value (every line needs the metric)")
        value = rec[name]
        if text:
            low = str(value).strip().lower()
            if low in _CORRECT_TEXT:
                value = _CORRECT_TEXT[low]
            else:
                try:
                    value = float(low)
                except ValueError:
                    raise ItemsError(f"{where}: {name} = {rec[name]!r} is not a number or "
                                     "true/false") from None
        seed = rec.get("seed")
        if seed in (None, ""):
            seed = None
        elif text and re.fullmatch(r"\s*-?\d+\s*", seed):
            seed = int(seed)
        elif text or isinstance(seed, bool) or not isinstance(seed, int):
            raise ItemsError(f"{where}: seed = {rec['seed']!r} is not an integer")
        item = _item_id(rec["item_id"] if not text else rec["item_id"].strip(), where, "item_id")
        per_seed.setdefault(seed, []).append((item, _score(value, name, where), lineno))
        cat = rec.get("category")
        has_cat.add(cat not in (None, ""))
        if cat not in (None, ""):
            cats.setdefault(seed, {})[item] = str(cat)
    if not per_seed:
        raise ItemsError(f"{path}: no items (an empty file)")
    if len(has_cat) > 1:
        raise ItemsError(f"{path}: some lines have a category and some do not")
    if None in per_seed and len(per_seed) > 1:
        raise ItemsError(f"{path}: some lines have a seed and some do not")
    out = []
    for seed in sorted(per_seed, key=lambda s: -1 if s is None else s):
        f = _collect(path, fmt, name, path.stem, per_seed[seed], False)
        f.seed = seed
        if cats:
            f.categories = [cats[seed][i] for i in f.ids]
        out.append(f)
    return out


def read_jsonl(path: Path, metric: str | None) -> list[ItemFile]:
    return _plain_rows(path, _lines(path), metric, text=False)


def read_csv(path: Path, metric: str | None) -> list[ItemFile]:
    def records() -> Iterator[tuple[int, dict[str, Any]]]:
        try:
            f = path.open(newline="", encoding="utf-8")
        except OSError as e:
            raise ItemsError(f"{path}: cannot read: {e.strerror or e}") from None
        with f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                return
            for rec in reader:
                if None in rec:
                    raise ItemsError(f"{path}:{reader.line_num}: more fields than the header names")
                yield reader.line_num, rec
    return _plain_rows(path, records(), metric, text=True)


#: format name -> reader of one file
FORMATS: dict[str, Callable[[Path, str | None], Any]] = {
    "lm_eval": read_lm_eval, "tinker_cookbook": read_tinker_cookbook, "prime_rl": read_prime_rl,
    "verl": read_verl, "jsonl": read_jsonl, "csv": read_csv,
}
# the keys that tell a format from its first line
_SIGNATURES = (("lm_eval", ("doc_id", "filter", "metrics")),
               ("tinker_cookbook", ("idx", "benchmark", "reward")),
               ("prime_rl", ("example_id", "reward", "is_truncated")),
               ("verl", ("input", "output", "score")),
               ("jsonl", ("item_id",)))
_LM_EVAL_FILE = re.compile(r"^samples_(.+)_(\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")
# one run's folder: the files of each format inside it, and the category each file gives its items
_FOLDER_PATTERNS = {"lm_eval": "**/samples_*.jsonl", "tinker_cookbook": "*/trajectories.jsonl",
                    "prime_rl": "eval_rollouts*.jsonl"}


def detect_format(path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "csv"
    for _, obj in _lines(path):
        for fmt, keys in _SIGNATURES:
            if all(k in obj for k in keys):
                return fmt
        raise ItemsError(f"{path}: format not recognised from its first line (keys {sorted(obj)[:12]}); name "
                         f"it with --format ({', '.join(FORMATS)})")
    raise ItemsError(f"{path}: no items (an empty file)")


def _folder_files(folder: Path, fmt: str | None) -> tuple[str, list[tuple[Path, str]]]:
    """(format, [(file, category)]) of one run's output folder."""
    found = {f: sorted(p for p in folder.glob(pat) if p.is_file()) for f, pat in _FOLDER_PATTERNS.items()
             if fmt in (None, f)}
    found = {f: ps for f, ps in found.items() if ps}
    if len(found) != 1:
        what = "none" if not found else ", ".join(sorted(found))
        raise ItemsError(f"{folder}: a folder must be one run's output of lm_eval "
                         "(samples_<task>_<date>.jsonl), tinker_cookbook (<benchmark>/trajectories.jsonl) or "
                         f"prime_rl (eval_rollouts*.jsonl) files; found {what}: name the file(s)")
    (f, paths), = found.items()
    if f == "lm_eval":
        tasks: dict[str, Path] = {}
        for p in paths:
            m = _LM_EVAL_FILE.match(p.name)
            task = m.group(1) if m else p.stem
            if task in tasks:
                raise ItemsError(f"{folder}: two sample files of task {task!r} ({tasks[task].name}, "
                                 f"{p.name}): runs at two dates in one folder; name the file(s)")
            tasks[task] = p
        return f, [(p, t) for t, p in sorted(tasks.items())]
    if f == "tinker_cookbook":
        return f, [(p, p.parent.name) for p in paths]
    return f, [(p, p.stem.removeprefix("eval_rollouts").lstrip("_") or "eval") for p in paths]


def read_items(path: str | Path, fmt: str | None = None, metric: str | None = None) -> list[ItemFile]:
    """One file (or one run's folder) -> its ItemFile(s): one, or one per seed of a plain file."""
    path = Path(path)
    if path.is_dir():
        fmt, parts = _folder_files(path, fmt)
        files = [FORMATS[fmt](p, metric) for p, _ in parts]
        if len(files) == 1:
            return files
        metrics = {f.metric for f in files}
        if len(metrics) > 1:
            raise ItemsError(f"{path}: its files score different metrics ({sorted(metrics)}); name one with "
                             "--metric")
        ids, scores, cats, notes = [], [], [], []
        for f, (_, cat) in zip(files, parts):
            ids += [f"{cat}/{i}" for i in f.ids]
            cats += [cat] * len(f.ids)
            scores.append(f.scores_N)
            notes += f.notes
        return [ItemFile(path=path, format=fmt, metric=files[0].metric,
                         eval_name=",".join(c for _, c in parts), ids=ids, scores_N=np.concatenate(scores),
                         categories=cats, repeats=max(f.repeats for f in files), notes=notes)]
    if not path.is_file():
        raise ItemsError(f"{path}: not found")
    fmt = fmt or detect_format(path)
    got = FORMATS[fmt](path, metric)
    return got if isinstance(got, list) else [got]
