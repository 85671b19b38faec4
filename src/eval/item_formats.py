"""Format adapters: per-item result files of other frameworks -> one score in [0, 1] per item id.

Each adapter reads one file (or one run's folder of files, one per task/benchmark/env, whose name then becomes
the items' category and the prefix `<task>/` of their ids) and returns ItemFile objects. The formats, each
read from the writer's own source at the version named:

- `lm_eval`: lm-evaluation-harness `--log_samples`, `samples_<task>_<date>.jsonl` (0.4.13:
  lm_eval/evaluator.py `evaluate`, the `example` dict: `doc_id`, `doc`, `target`, `arguments`, `resps`,
  `filtered_resps`, `filter`, `metrics` (the names), `doc_hash`, `prompt_hash`, `target_hash`, then one key
  per metric; lm_eval/loggers/evaluation_tracker.py `save_results_samples` writes one JSON line per sample and
  filter). The item id is `doc_id` (the document's position in the task), checked against `doc_hash` (the
  sha256 of the document) in every file. `--metric acc` or `acc,<filter>`; the default is the first metric of
  the file's first filter, and a run's folder scores each task by its own (one category per task). Older
  files (EleutherAI/lm-evaluation-harness v0.4.5 @0845b58, evaluator.py: 0.4.3-0.4.6 write no `filter` /
  `metrics`; v0.4.2 @4600d6b, __main__.py: 0.4.0-0.4.2 write no hashes either, as one JSON array in
  `<model_args>_<task>.jsonl`) are read with filter `none` and the first per-sample metric key; a doc_id on
  two lines (several filters, unnamed) is refused. `results_<date>.json` is refused with a pointer to the
  samples files.
- `tinker_cookbook`: tinker-cookbook 0.5.8 EvalStore, `runs/<run_id>/<benchmark>/trajectories.jsonl`
  (tinker_cookbook/eval/benchmarks/_types.py `StoredTrajectory.to_dict`: `idx`, `benchmark`, `example_id`,
  `turns`, `reward`, `metrics`, `logs`, `error`, `time_seconds`; written by `_runner.py` `_save_trajectory`).
  The id is `example_id` (`make_example_id`: a hash of the question); the default score is `reward > 0`, the
  runner's own accuracy (`BenchmarkBuilder.aggregate`); `--metric reward` or a key of `metrics`. A failed
  trajectory (a timeout: `error` set, reward 0, `metrics` empty) scores 0 on every metric, as the runner
  scores it, with a note.
- `prime_rl`: prime-rl v0.6.0 eval rollouts, `rollouts/step_<n>/eval_rollouts_<env>.jsonl` (and
  `eval_rollouts.jsonl`, PR #2248) (src/prime_rl/orchestrator/orchestrator.py `finalize_eval_batch`,
  utils.py `save_rollouts`: orjson lines of `FinishedRollout.to_dict()` without `trajectory`; the fields are
  verifiers@78c1b3c `state_to_output`: `example_id`, `prompt`, `completion`, `answer`, `info`, `reward`,
  `error`, `timing`, `is_completed`, `is_truncated`, `stop_condition`, `metrics`, plus `env_name`,
  `group_id`, `policy_version`, `off_policy_steps`, `rollout_id`, `eval_step`), and prime-rl >= v0.7.0
  `rollouts/step_<n>/eval/all/traces.jsonl` (read_prime_rl_traces). The id is `example_id` (the dataset
  index), checked against the hash of the question (the prompt's last user message) and `answer`; the
  default score is `reward`, or a key of `metrics`. Errored rollouts are left out of their item's mean, as
  prime-rl's eval reward leaves them out (v0.6.0 `EvalSink`, v0.7.0 the `effective` subset).
- `verl`: verl validation dumps, `<trainer.validation_data_dir>/<global_step>.jsonl` (volcengine/verl
  v0.7.0 @f9c855f7c, verl/trainer/ppo/ray_trainer.py `_validate` -> `_dump_generations`: `input`, `output`,
  `gts`, `score`, `step`, then each reward-extra-info list, e.g. `reward`, `acc`); a folder gives its latest
  step. The dump has no id: the item id is the sha256 of the decoded prompt `input` (a prompt text on two
  dataset rows is refused as such); the default score is `score`, or another key of the line.
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
MAX_JSON_FILE_BYTES = 256 * 1024 * 1024  # a whole-file JSON (lm-eval < 0.4.3 samples, results_*.json)


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
    # what each item is, beside its id (lm-eval's doc_hash, prime-rl's question and answer): two files that
    # hold another item behind one id are refused; None where the format has no such field
    content: list[str] | None = None
    content_key: str = ""
    # ids the file holds without a score (every sample of theirs errored): left out of every arm
    left_out: list[str] = field(default_factory=list)
    left_out_categories: list[str] | None = None
    category_kind: str = "category"  # what a category is called in messages: task, benchmark, env
    metrics_by_category: dict[str, str] | None = None  # a folder whose tasks each keep their own metric

    def scores_in(self, order: list[str]) -> np.ndarray:
        if self.ids == order:
            return self.scores_N
        pos = {i: k for k, i in enumerate(self.ids)}
        return self.scores_N[np.fromiter((pos[i] for i in order), dtype=np.int64, count=len(order))]

    def categories_by_id(self) -> dict[str, str] | None:
        if self.categories is None:
            return None
        return dict(zip(self.ids + self.left_out, self.categories + (self.left_out_categories or [])))

    def content_by_id(self) -> dict[str, str] | None:
        return None if self.content is None else dict(zip(self.ids, self.content))


# ----------------------------------------------------------------------------- reading helpers
def _parse(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ItemsError(f"{path}:{lineno}: not valid JSON ({e.msg}); truncated or corrupted file?") from None
    if not isinstance(obj, dict):
        raise ItemsError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(1-based line number, JSON object) of each non-blank line; errors name the file and line. A file that
    is one JSON array of objects (lm-eval 0.4.0-0.4.2 wrote its samples so) gives its elements, numbered from
    1."""
    try:
        f = path.open(encoding="utf-8")
    except OSError as e:
        raise ItemsError(f"{path}: cannot read: {e.strerror or e}") from None
    n = 0
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if n == 0 and line.lstrip().startswith("["):
                yield from _array(path)
                return
            if len(line) > MAX_LINE_CHARS:
                raise ItemsError(f"{path}:{lineno}: line longer than {MAX_LINE_CHARS} characters")
            if n == 0 and line.strip() == "{":
                _refuse_whole_json(path)
            obj = _parse(path, lineno, line)
            n += 1
            if n > MAX_LINES_PER_FILE:
                raise ItemsError(f"{path}: more than {MAX_LINES_PER_FILE} lines")
            yield lineno, obj


def _load_whole(path: Path) -> Any:
    if path.stat().st_size > MAX_JSON_FILE_BYTES:
        raise ItemsError(f"{path}: a whole-file JSON larger than {MAX_JSON_FILE_BYTES} bytes")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ItemsError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); truncated or corrupted "
                         "file?") from None


def _array(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    data = _load_whole(path)
    if not isinstance(data, list) or len(data) > MAX_LINES_PER_FILE:
        raise ItemsError(f"{path}: expected JSON lines, or one JSON array of at most {MAX_LINES_PER_FILE} "
                         "objects")
    for k, obj in enumerate(data, start=1):
        if not isinstance(obj, dict):
            raise ItemsError(f"{path}: element {k} is a {type(obj).__name__}, not a JSON object")
        yield k, obj


def _refuse_lm_eval_results(path: Path, obj: Any) -> None:
    """lm-eval's results_<date>.json (evaluation_tracker.py `save_results_aggregated`: `results`, `configs`,
    `versions`, ...) holds one number per task: point to the files that hold the items."""
    if isinstance(obj, dict) and "results" in obj and ("configs" in obj or "versions" in obj):
        raise ItemsError(f"{path}: lm-eval's aggregate results (one accuracy per task, no per-item scores): "
                         "run lm_eval with --log_samples and pass its samples_<task>_<date>.jsonl files, or "
                         "the output folder that holds them")


def _refuse_whole_json(path: Path) -> None:
    """A pretty-printed JSON object is no per-item file."""
    data = _load_whole(path)
    _refuse_lm_eval_results(path, data)
    raise ItemsError(f"{path}: one JSON object, not per-item lines: pass a file with one JSON object per item "
                     "per line (or CSV)")


def _score(value: Any, what: str, where: str, others: list[str] | None = None) -> float:
    """A per-item score: a bool (1/0) or a finite number in [0, 1]; `others` are the per-item values the record
    also holds, named when this one is refused."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)):
        x = float(value)
        if math.isfinite(x) and 0.0 <= x <= 1.0:
            return x
    if isinstance(value, (list, dict)):
        raise ItemsError(f"{where}: {what} is {type(value).__name__}, not a per-item score (a corpus-level "
                         "metric such as bleu keeps its inputs per item, not a score): pick a per-item "
                         "metric with --metric")
    hint = f"; this record's other values: {others}, name one in [0, 1] with --metric" if others else ""
    raise ItemsError(f"{where}: {what} = {value!r} is not a score in [0, 1] (a finite number or "
                     f"true/false); rewards on another scale are refused, not rescaled{hint}")


# (item id, score or None for an errored sample, line, what the item is or None)
Row = tuple[str, "float | None", int, "str | None"]


def _collect(path: Path, fmt: str, metric: str, eval_name: str, rows: list[Row], repeats_ok: bool,
             notes: list[str] | None = None, content_key: str = "",
             unequal: Callable[[dict[str, int]], None] | None = None) -> ItemFile:
    """ItemFile from rows: duplicates refused, or (repeats_ok) averaged at an equal count. An errored sample
    (score None) counts toward that count but not toward the mean; an item whose samples all errored has no
    score and is listed in `left_out`. `unequal(counts)` may raise a format's own message when the counts
    differ."""
    if not rows:
        raise ItemsError(f"{path}: no items (an empty file, or no line for {metric})")
    notes = list(notes or [])
    first: dict[str, int] = {}
    sums: dict[str, float] = {}
    valid: dict[str, int] = {}
    counts: dict[str, int] = {}
    content: dict[str, str] = {}
    dups: list[tuple[str, int]] = []
    errored = 0
    for item, score, lineno, what in rows:
        if item in first:
            dups.append((item, lineno))
            counts[item] += 1
            if what is not None and content.setdefault(item, what) != what:
                raise ItemsError(f"{path}:{lineno}: item {item!r} has another {content_key} than on line "
                                 f"{first[item]}: one id names two items")
        else:
            first[item], sums[item], valid[item], counts[item] = lineno, 0.0, 0, 1
            if what is not None:
                content[item] = what
        if score is None:
            errored += 1
        else:
            sums[item] += score
            valid[item] += 1
    if dups and not repeats_ok:
        item, lineno = dups[0]
        raise ItemsError(f"{path}:{lineno}: duplicate item id {item!r} (first on line {first[item]}); "
                         f"{len(dups)} line(s) repeat an id of {len(first)} items: an id must name one item")
    k = set(counts.values())
    if len(k) > 1:
        if unequal is not None:
            unequal(counts)
        few = min(first, key=lambda i: counts[i])
        raise ItemsError(f"{path}: items have different numbers of samples ({sorted(k)}; e.g. {few!r} "
                         f"has {counts[few]}): an item's score is the mean of its samples, so every item "
                         "needs as many")
    repeats = k.pop()
    if repeats > 1:
        notes.append(f"{fmt} {eval_name}: {repeats} samples per item, each item's score their mean")
    ids = [i for i in first if valid[i]]
    left_out = [i for i in first if not valid[i]]
    scores = np.fromiter((sums[i] / valid[i] for i in ids), dtype=np.float64, count=len(ids))
    return ItemFile(path=path, format=fmt, metric=metric, eval_name=eval_name, ids=ids, scores_N=scores,
                    repeats=repeats, notes=notes, left_out=left_out,
                    content=[content.get(i, "") for i in ids] if content else None, content_key=content_key)


def _metric_score(obj: dict[str, Any], metric: str, where: str, what: str) -> float:
    """A named entry of a record's `metrics` (cookbook trajectories and prime-rl rollouts both keep them
    beside `reward`), checked like any score; a missing one names those the record has."""
    ms = obj.get("metrics") or {}
    if metric not in ms:
        raise ItemsError(f"{where}: no metric {metric!r} (this {what} has reward and metrics {sorted(ms)})")
    return _score(ms[metric], f"metric {metric!r}", where, sorted(ms))


def _item_id(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ItemsError(f"{where}: `{key}` must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _question(prompt: Any) -> str:
    """What one dataset row asks, from a chat prompt: its last user message (a system prompt or few-shot
    turns before it may differ between arms, as a treatment)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return json.dumps(users[-1].get("content"), sort_keys=True, ensure_ascii=False)
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)


# ----------------------------------------------------------------------------- the adapters
# the keys of an lm-eval sample line that are not metrics (evaluator.py's `example` before `update(metrics)`)
_LM_EVAL_KEYS = {"doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics",
                 "doc_hash", "prompt_hash", "target_hash"}


def read_lm_eval(path: Path, metric: str | None) -> ItemFile:
    want_metric, _, want_filter = (metric or "").partition(",")
    by_filter: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    old = None  # a file of lm-eval < 0.4.7: no `filter` / `metrics` keys
    for lineno, obj in _lines(path):
        if "doc_id" not in obj:
            raise ItemsError(f"{path}:{lineno}: no `doc_id` (not an lm-evaluation-harness --log_samples line?)")
        is_old = "filter" not in obj and "metrics" not in obj
        if old is None:
            old = is_old
        elif old != is_old:
            raise ItemsError(f"{path}:{lineno}: some lines name their `filter` / `metrics` and some do not")
        if not is_old and ("filter" not in obj or "metrics" not in obj):
            raise ItemsError(f"{path}:{lineno}: a `filter` without `metrics` or the reverse (not an "
                             "lm-evaluation-harness --log_samples line?)")
        by_filter.setdefault("none" if is_old else str(obj["filter"]), []).append((lineno, obj))
    if not by_filter:
        raise ItemsError(f"{path}: no items (an empty file)")
    filters = list(by_filter)
    notes = []
    if old:
        lines = by_filter["none"]
        seen: dict[Any, int] = {}
        for lineno, obj in lines:
            if obj["doc_id"] in seen:
                raise ItemsError(f"{path}:{lineno}: doc_id {obj['doc_id']!r} again (first on line "
                                 f"{seen[obj['doc_id']]}): an lm-eval file older than 0.4.7 names no filter, so "
                                 "a task with several filters cannot be read from it; rerun with lm-eval "
                                 ">= 0.4.7, or compare a task with one filter")
            seen[obj["doc_id"]] = lineno
        if want_filter and want_filter != "none":
            raise ItemsError(f"{path}: no filter {want_filter!r} (a file older than lm-eval 0.4.7 names none)")
        flt = "none"
        listed = [k for k, v in lines[0][1].items() if k not in _LM_EVAL_KEYS
                  and isinstance(v, (int, float))]
        notes.append(f"{path}: an lm-eval file older than 0.4.7 (no `filter` / `metrics` keys): metric read from "
                     "the per-sample keys, filter taken as 'none'")
    else:
        if want_filter:
            if want_filter not in by_filter:
                raise ItemsError(f"{path}: no filter {want_filter!r} (the file has {filters})")
            flt = want_filter
        else:
            flt = filters[0]
            if len(filters) > 1:
                task = _LM_EVAL_FILE.match(path.name)
                notes.append(f"{task.group(1) if task else path.stem}: lm-eval filter {flt!r} of {filters} "
                             "(name another as --metric <metric>,<filter>)")
        lines = by_filter[flt]
        listed = list(lines[0][1]["metrics"] or [])
    name = want_metric or (listed or [None])[0]
    if not name:
        raise ItemsError(f"{path}:{lines[0][0]}: the sample lists no metrics; name one with --metric")
    rows: list[Row] = []
    for lineno, obj in lines:
        where = f"{path}:{lineno}"
        if name not in obj:
            have = obj.get("metrics") if not old else [k for k in obj if k not in _LM_EVAL_KEYS]
            raise ItemsError(f"{where}: no metric {name!r} (this sample has {have})"
                             + ("; name one of them with --metric, or leave --metric out to score each task "
                                "by its own first metric" if want_metric else "; name one with --metric"))
        item = _item_id(obj["doc_id"], where, "doc_id")
        doc = obj.get("doc_hash")
        rows.append((item, _score(obj[name], f"metric {name!r}", where), lineno,
                     doc if isinstance(doc, str) else None))
    task = _LM_EVAL_FILE.match(path.name)
    eval_name = task.group(1) if task else path.stem
    f = _collect(path, "lm_eval", f"{name},{flt}", eval_name, rows, False, notes, content_key="doc_hash")
    f.category_kind = "task"
    return f


def read_tinker_cookbook(path: Path, metric: str | None) -> ItemFile:
    rows: list[Row] = []
    benchmarks: set[str] = set()
    by_prompt = errored = 0
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        if "idx" not in obj or "reward" not in obj:
            raise ItemsError(f"{where}: no `idx`/`reward` (not a tinker-cookbook trajectories.jsonl line?)")
        item = obj.get("example_id")
        # the runner's fallback id is str(idx) (_runner.py `_get_example_id`: "unstable across shuffles and
        # pass@k rounds"), a position: such items are matched by their prompt's text instead
        if not item or item == str(obj["idx"]):
            turns = obj.get("turns") or []
            first = next((t.get("content") for t in turns if isinstance(t, dict) and t.get("role") == "user"),
                         None)
            if not isinstance(first, str):
                raise ItemsError(f"{where}: no `example_id` and no user turn to name the item by")
            item, by_prompt = "prompt:" + _sha(first)[:16], by_prompt + 1
        benchmarks.add(str(obj.get("benchmark", "")))
        failed = bool(obj.get("error"))
        errored += failed
        if metric in (None, "reward>0"):
            r = obj["reward"]
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise ItemsError(f"{where}: reward = {r!r} is not a finite number")
            score = 1.0 if r > 0 else 0.0
        elif metric == "reward":
            score = _score(obj["reward"], "reward", where, sorted(obj.get("metrics") or {}))
        elif failed and metric not in (obj.get("metrics") or {}):
            score = 0.0  # the runner saves a timed-out / failed trajectory with reward 0 and no metrics
        else:
            score = _metric_score(obj, metric, where, "trajectory")
        rows.append((_item_id(item, where, "example_id"), score, lineno, None))
    notes = []
    if by_prompt:
        notes.append(f"{path}: {by_prompt} trajectories carry no example_id but their position (idx): matched "
                     "by their prompt's text instead")
    if errored:
        notes.append(f"{path}: {errored} trajectory(ies) ended in an error (a timeout, say): each scores 0 on "
                     f"{metric or 'reward>0'}, as the runner scores their reward 0")
    name = ",".join(sorted(benchmarks)) or path.parent.name
    f = _collect(path, "tinker_cookbook", metric or "reward>0", name, rows, True, notes)
    f.category_kind = "benchmark"
    return f


def _prime_score(obj: dict[str, Any], reward: float | None, metric: str | None, where: str) -> float:
    if metric in (None, "reward"):
        others = sorted(obj.get("metrics") or {})
        return _score(reward, "reward", where, others)
    return _metric_score(obj, metric, where, "rollout")


def read_prime_rl(path: Path, metric: str | None) -> ItemFile:
    """prime-rl's own eval accuracy leaves errored rollouts out (v0.6.0 `EvalSink`; v0.7.0 the `effective`
    subset): here too, an errored rollout adds nothing to its item's mean, and an item whose rollouts all
    errored is left out of every arm (a note counts both)."""
    rows: list[Row] = []
    errors = 0
    envs: set[str] = set()
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        if "example_id" not in obj or "reward" not in obj:
            raise ItemsError(f"{where}: no `example_id`/`reward` (not a prime-rl eval rollouts line?)")
        failed = obj.get("error") is not None
        errors += failed
        envs.add(str(obj.get("env_name", "")))
        score = None if failed else _prime_score(obj, obj["reward"], metric, where)
        what = _sha(_question(obj.get("prompt")) + "\n" + json.dumps(obj.get("answer"), default=str))
        rows.append((_item_id(obj["example_id"], where, "example_id"), score, lineno, what))
    name = ",".join(sorted(e for e in envs if e)) or path.stem
    f = _collect(path, "prime_rl", metric or "reward", name, rows, True, _error_notes(path, errors),
                 content_key="question and answer")
    f.category_kind = "env"
    return f


def _error_notes(path: Path, errors: int) -> list[str]:
    if not errors:
        return []
    note = (f"{path}: {errors} rollout(s) ended in an error: left out of their item's mean, as prime-rl's own "
            "eval reward leaves them out")
    return [note]


def read_prime_rl_traces(path: Path, metric: str | None) -> ItemFile:
    """prime-rl >= v0.7.0 `rollouts/step_<n>/eval/{all,effective}/traces.jsonl` (PrimeIntellect-ai/prime-rl
    v0.7.0 @8cab1e5, src/prime_rl/orchestrator/orchestrator.py: every eval rollout appended to `all` as it
    arrives, the non-errored ones to `effective` per finished epoch; a record is `Rollout.to_record()` of
    src/prime_rl/orchestrator/types.py = verifiers@6c64ce6 verifiers/v1/trace.py `Trace.to_record()` (`id`,
    `task: {type, data: {idx, prompt, ...}}`, `nodes`, `rewards` (weighted parts; the reward is their sum),
    `metrics`, `errors`, `is_completed`, ...) plus `kind`, `env_name`, `group_id`, `policy_version`,
    `eval_step`). The item id is `task.data.idx`, beside the hash of its question and answer; errored records
    are left out as prime-rl's `effective` subset leaves them."""
    rows: list[Row] = []
    errors = 0
    envs: set[str] = set()
    env_of: dict[str, str] = {}
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        task = obj.get("task")
        data = task.get("data") if isinstance(task, dict) else None
        if not isinstance(data, dict) or "idx" not in data or not isinstance(obj.get("rewards"), dict):
            raise ItemsError(f"{where}: no `task.data.idx`/`rewards` (not a prime-rl traces.jsonl record?)")
        if obj.get("kind", "eval") != "eval":
            raise ItemsError(f"{where}: a {obj.get('kind')!r} trace: pass the eval traces "
                             "(rollouts/step_<n>/eval/all/traces.jsonl)")
        failed = bool(obj.get("errors"))
        errors += failed
        env = str(obj.get("env_name") or "")
        envs.add(env)
        parts = obj["rewards"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parts.values()):
            raise ItemsError(f"{where}: `rewards` must map names to numbers, got {parts!r}")
        score = None if failed else _prime_score(obj, float(sum(parts.values())), metric, where)
        what = _sha(_question(data.get("prompt")) + "\n" + json.dumps(data.get("answer"), default=str))
        item = f"{env or 'eval'}/{_item_id(data['idx'], where, 'task.data.idx')}"
        env_of[item] = env or "eval"
        rows.append((item, score, lineno, what))
    name = ",".join(sorted(e for e in envs if e)) or "eval"
    notes = _error_notes(path, errors)
    if path.parent.name == "effective":
        notes.append(f"{path}: the `effective` subset holds no errored rollout, so an item whose rollouts all "
                     "errored is missing here but not in another arm; pass eval/all/traces.jsonl (or the step "
                     "folder) to leave such items out of every arm")
    f = _collect(path, "prime_rl", metric or "reward", name, rows, True, notes, content_key="question and answer")
    # the envs of one eval step share the file: each is a category, its name a prefix of the ids
    f.categories = [env_of[i] for i in f.ids]
    f.left_out_categories = [env_of[i] for i in f.left_out]
    f.category_kind = "env"
    return f


def read_verl(path: Path, metric: str | None) -> ItemFile:
    rows: list[Row] = []
    name = metric or "score"
    first: dict[str, tuple[int, str]] = {}
    for lineno, obj in _lines(path):
        where = f"{path}:{lineno}"
        if "input" not in obj or "score" not in obj:
            raise ItemsError(f"{where}: no `input`/`score` (not a verl validation dump line?)")
        if not isinstance(obj["input"], str):
            raise ItemsError(f"{where}: `input` must be the prompt text, got {type(obj['input']).__name__}")
        if name not in obj:
            raise ItemsError(f"{where}: no key {name!r} (this line has {sorted(obj)})")
        item = _sha(obj["input"])
        first.setdefault(item, (lineno, obj["input"]))
        rows.append((item, _score(obj[name], f"{name!r}", where, sorted(obj)), lineno, None))

    def shared_prompt(counts: dict[str, int]) -> None:
        # n samples per prompt: a prompt text on two dataset rows comes 2n times
        n = min(counts.values())
        twice = [i for i, c in counts.items() if c != n and c % n == 0]
        if twice and len(twice) + sum(c == n for c in counts.values()) == len(counts):
            lineno, text = first[twice[0]]
            raise ItemsError(f"{path}:{lineno}: {len(twice)} prompt text(s) come {counts[twice[0]] // n}x as "
                             f"often as the others (e.g. {text[:60]!r}): two rows of the validation set share "
                             "one prompt, and a verl dump has no item id, so they cannot be told apart; "
                             "deduplicate the validation set's prompts")

    return _collect(path, "verl", name, f"verl step {path.stem}", rows, True,
                    ["verl dumps carry no item id: items are matched by the sha256 of their prompt text"],
                    unequal=shared_prompt)


_CORRECT_TEXT = {"true": True, "false": False, "1": True, "0": False}


def _plain_rows(path: Path, records: Iterator[tuple[int, dict[str, Any]]], metric: str | None,
                text: bool) -> list[ItemFile]:
    per_seed: dict[int | None, list[Row]] = {}
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
        per_seed.setdefault(seed, []).append((item, _score(value, name, where), lineno, None))
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


def read_prime_rl_any(path: Path, metric: str | None) -> ItemFile:
    """prime-rl's eval rollouts of either layout: v0.6 `eval_rollouts*.jsonl`, v0.7+ `traces.jsonl`."""
    for _, obj in _lines(path):
        return (read_prime_rl_traces if "task" in obj and "rewards" in obj else read_prime_rl)(path, metric)
    raise ItemsError(f"{path}: no items (an empty file)")


#: format name -> reader of one file
FORMATS: dict[str, Callable[[Path, str | None], Any]] = {
    "lm_eval": read_lm_eval, "tinker_cookbook": read_tinker_cookbook, "prime_rl": read_prime_rl_any,
    "verl": read_verl, "jsonl": read_jsonl, "csv": read_csv,
}
# the keys that tell a format from its first line
_SIGNATURES = (("lm_eval", ("doc_id", "filter", "metrics")),
               ("lm_eval", ("doc_id", "doc", "resps")),  # lm-eval < 0.4.7: no filter / metrics
               ("tinker_cookbook", ("idx", "benchmark", "reward")),
               ("prime_rl", ("example_id", "reward", "is_truncated")),
               ("prime_rl", ("task", "rewards", "errors")),  # v0.7+ traces.jsonl
               ("verl", ("input", "output", "score")),
               ("jsonl", ("item_id",)))
_LM_EVAL_FILE = re.compile(r"^samples_(.+)_(\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")
_VERL_DUMP = re.compile(r"^\d+\.jsonl$")
# one run's folder: the files of each format inside it, and the category each file gives its items
_FOLDER_PATTERNS = {"lm_eval": "**/samples_*.jsonl", "tinker_cookbook": "*/trajectories.jsonl",
                    "prime_rl": "eval_rollouts*.jsonl", "prime_rl_traces": "eval/all/traces.jsonl",
                    "verl": "*.jsonl"}
_CATEGORY_KIND = {"lm_eval": "task", "tinker_cookbook": "benchmark", "prime_rl": "env"}


def detect_format(path: Path) -> str:
    if path.suffix.lower() == ".csv":
        return "csv"
    for _, obj in _lines(path):
        _refuse_lm_eval_results(path, obj)
        for fmt, keys in _SIGNATURES:
            if all(k in obj for k in keys):
                return fmt
        raise ItemsError(f"{path}: format not recognised from its first line (keys {sorted(obj)[:12]}); name "
                         f"it with --format ({', '.join(FORMATS)})")
    raise ItemsError(f"{path}: no items (an empty file)")


_FOLDER_HELP = ("pass one run's output folder (lm-eval: samples_<task>_<date>.jsonl; tinker-cookbook: "
                "runs/<run_id>; prime-rl: rollouts/step_<n>; verl: trainer.validation_data_dir) or one file; "
                "comma-separated files are one arm's seeds, not its tasks")


def _folder_files(folder: Path, fmt: str | None) -> tuple[str, list[tuple[Path, str]], list[str]]:
    """(format, [(file, category)], notes) of one run's output folder."""
    found = {f: sorted(p for p in folder.glob(pat) if p.is_file()) for f, pat in _FOLDER_PATTERNS.items()
             if fmt in (None, f.removesuffix("_traces"))}
    found["verl"] = [p for p in found.get("verl", []) if _VERL_DUMP.match(p.name)]
    found = {f: ps for f, ps in found.items() if ps}
    if len(found) != 1:
        if not found and (folder / "runs").is_dir() and any((folder / "runs").glob("*/*/trajectories.jsonl")):
            runs = sorted(p.name for p in (folder / "runs").iterdir() if p.is_dir())
            raise ItemsError(f"{folder}: a tinker-cookbook EvalStore holding runs {runs[:5]}: name one run, "
                             f"{folder / 'runs' / (runs[0] if runs else '<run_id>')}")
        steps = sorted((p for p in folder.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))
        if not found and steps:
            raise ItemsError(f"{folder}: prime-rl rollouts of steps {[p.name for p in steps[:5]]}"
                             f"{'...' if len(steps) > 5 else ''}: name one step folder, e.g. the last, {steps[-1]}")
        what = ("none of the per-item files this command reads" if not found
                else f"files of several formats ({', '.join(sorted(found))})")
        raise ItemsError(f"{folder}: found {what}: {_FOLDER_HELP}")
    (f, paths), = found.items()
    if f == "lm_eval":
        tasks: dict[str, Path] = {}
        for p in paths:
            m = _LM_EVAL_FILE.match(p.name)
            task = m.group(1) if m else p.stem
            if task in tasks:
                raise ItemsError(f"{folder}: two sample files of task {task!r} ({tasks[task].name}, "
                                 f"{p.name}): two lm_eval runs wrote into one folder; move each run's files "
                                 "(samples and results) into a folder of its own and pass that folder")
            tasks[task] = p
        return f, [(p, t) for t, p in sorted(tasks.items())], []
    if f == "tinker_cookbook":
        return f, [(p, p.parent.name) for p in paths], []
    if f == "prime_rl_traces":
        return "prime_rl", [(paths[0], "")], []
    if f == "verl":
        latest = max(paths, key=lambda p: int(p.stem))
        note = (f"{folder}: verl dumps of steps {sorted(int(p.stem) for p in paths)}: the latest, "
                f"{latest.name}, is read (name another file to compare another step)") if len(paths) > 1 else ""
        return f, [(latest, "")], [note] if note else []
    return f, [(p, p.stem.removeprefix("eval_rollouts").lstrip("_") or "eval") for p in paths], []


def read_items(path: str | Path, fmt: str | None = None, metric: str | None = None) -> list[ItemFile]:
    """One file (or one run's folder) -> its ItemFile(s): one, or one per seed of a plain file. A folder's
    files (one per task / benchmark / env) become one ItemFile whose ids are `<task>/<id>` and whose
    categories are the tasks; without --metric each task keeps its own default metric."""
    path = Path(path)
    if path.is_dir():
        fmt, parts, folder_notes = _folder_files(path, fmt)
        files = [FORMATS[fmt](p, metric) for p, _ in parts]
        if len(parts) == 1 and parts[0][1] == "":  # one file that names its own items (verl, prime-rl traces)
            files[0].notes += folder_notes
            return files
        by_cat = {cat: f.metric for f, (_, cat) in zip(files, parts)}
        metrics = set(by_cat.values())
        ids, left, left_cats, scores, cats, notes, content = [], [], [], [], [], list(folder_notes), []
        for f, (_, cat) in zip(files, parts):
            ids += [f"{cat}/{i}" for i in f.ids]
            left += [f"{cat}/{i}" for i in f.left_out]
            left_cats += [cat] * len(f.left_out)
            cats += [cat] * len(f.ids)
            scores.append(f.scores_N)
            notes += f.notes
            content += f.content or [""] * len(f.ids)
        if len(metrics) > 1:
            notes.append(f"each {_CATEGORY_KIND[fmt]} is scored by its own first metric ("
                         + ", ".join(f"{c}: {m}" for c, m in by_cat.items())
                         + "); an arm's overall accuracy averages them, item by item")
        metric_name = (files[0].metric if len(metrics) == 1
                       else "; ".join(f"{c}: {m}" for c, m in by_cat.items()))
        has_content = any(f.content is not None for f in files)
        return [ItemFile(path=path, format=fmt, metric=metric_name, eval_name=",".join(c for _, c in parts),
                         ids=ids, scores_N=np.concatenate(scores), categories=cats,
                         repeats=max(f.repeats for f in files), notes=notes,
                         content=content if has_content else None, content_key=files[0].content_key,
                         left_out=left, left_out_categories=left_cats, category_kind=_CATEGORY_KIND[fmt], metrics_by_category=by_cat)]
    if not path.is_file():
        raise ItemsError(f"{path}: not found")
    fmt = fmt or detect_format(path)
    got = FORMATS[fmt](path, metric)
    return got if isinstance(got, list) else [got]
