"""Per-item eval records: `<run>/eval/<eval_name>.jsonl`, one JSON object per test item.

Each record has (at least) these keys:
  index            int >= 0, the item's position in the test split (the pairing key)
  question_sha256  64 lowercase hex chars, sha256 of the question text (guards the pairing)
  completion       str, the greedy completion
  parsed           str | null, the answer parsed from the completion
  gold             str | number, the reference answer
  correct          bool
and, with eval.samples_per_item K > 1 (K samples at eval.temperature instead of one greedy completion),
  score            float in [0, 1], the fraction of the K samples graded correct (`correct` is then
                   score >= 0.5, and `completion` / `parsed` are the first sample's)
  samples          int, K
eval.compare and summarize read `score` where present: the per-item score every paired method uses.
Extra keys are kept as they are.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eval.stats import wilson_interval
from trainer.utils.io import atomic_write_text

__all__ = ["REQUIRED_KEYS", "RecordError", "read_item_records", "summarize", "validate_record",
           "wilson_interval", "write_item_records"]

REQUIRED_KEYS = ("index", "question_sha256", "completion", "parsed", "gold", "correct")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class RecordError(ValueError):
    """A per-item eval file or record is malformed; the message names the file and line."""


def validate_record(rec: Any) -> None:
    """Raise ValueError naming the first problem of one record."""
    if not isinstance(rec, dict):
        raise ValueError(f"record must be a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise ValueError(f"record is missing key(s) {missing}")
    idx = rec["index"]
    if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
        raise ValueError(f"'index' must be an integer >= 0, got {idx!r}")
    sha = rec["question_sha256"]
    if not (isinstance(sha, str) and _SHA256.match(sha)):
        raise ValueError(f"'question_sha256' must be 64 lowercase hex characters, got {sha!r}")
    if not isinstance(rec["completion"], str):
        raise ValueError(f"'completion' must be a string, got {type(rec['completion']).__name__}")
    if rec["parsed"] is not None and not isinstance(rec["parsed"], str):
        raise ValueError(f"'parsed' must be a string or null, got {type(rec['parsed']).__name__}")
    gold = rec["gold"]
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise ValueError(f"'gold' must be a string or number, got {gold!r}")
    if not isinstance(rec["correct"], bool):
        raise ValueError(f"'correct' must be true/false, got {rec['correct']!r}")
    score = rec.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))
                              or not 0.0 <= score <= 1.0):  # NaN fails both comparisons
        raise ValueError(f"'score' must be a number in [0, 1] or absent, got {score!r}")


def write_item_records(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """Validate and write records atomically (temp file + fsync + os.replace); returns the path."""
    path = Path(path)
    records = list(records)
    seen: dict[int, int] = {}
    lines = []
    for i, rec in enumerate(records):
        try:
            validate_record(rec)
        except ValueError as e:
            raise RecordError(f"cannot write {path}: record {i}: {e}") from None
        if rec["index"] in seen:
            raise RecordError(f"cannot write {path}: records {seen[rec['index']]} and {i} share "
                              f"index {rec['index']}")
        seen[rec["index"]] = i
        lines.append(json.dumps(rec, ensure_ascii=False, sort_keys=True))
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    os.chmod(path, 0o644)  # the atomic writer's temp file is 0600
    return path


def read_item_records(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a per-item file; errors name the file and the 1-based line number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"eval records file not found: {path}")
    out: list[dict[str, Any]] = []
    first_line: dict[int, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # tolerate blank lines (e.g. a trailing newline)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{lineno}: not valid JSON ({e.msg}); "
                                  "truncated or corrupted file?") from None
            try:
                validate_record(rec)
            except ValueError as e:
                raise RecordError(f"{path}:{lineno}: {e}") from None
            idx = rec["index"]
            if idx in first_line:
                raise RecordError(f"{path}:{lineno}: duplicate index {idx} (first seen on line "
                                  f"{first_line[idx]})")
            first_line[idx] = lineno
            out.append(rec)
    if not out:
        raise RecordError(f"{path}: contains no item records")
    return out


def summarize(records: list[dict[str, Any]], *, alpha: float = 0.05, **extra: Any) -> dict[str, Any]:
    """n, accuracy and the Wilson interval of a list of records, plus `extra` (e.g. step, checkpoint)."""
    n = len(records)
    if n == 0:
        raise ValueError("summarize: no records")
    if any(r.get("score") is not None for r in records):
        # K samples per item: the mean score; Wilson's interval on the nearest whole count of items (the
        # item, not the sample, is the unit: K samples of one item are not K independent items)
        total = sum(float(r["score"]) if r.get("score") is not None else float(r["correct"]) for r in records)
        low, high = wilson_interval(round(total), n, alpha)
        return {"n": n, "accuracy": total / n, "wilson_low": low, "wilson_high": high, **extra}
    k = sum(1 for r in records if r["correct"] is True)
    low, high = wilson_interval(k, n, alpha)
    return {"n": n, "accuracy": k / n, "wilson_low": low, "wilson_high": high, **extra}
