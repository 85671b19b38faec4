"""GSM8K rows -> `Problem`s: vendored files (SHA-256 checked), a local folder, or the HF hub.

Gold answer: `tinker_cookbook.recipes.math_rl.math_env.extract_gsm8k_final_answer`
(tinker-cookbook 0.5.8): the text after the last line starting with '####', commas removed.
Train order: `seeded_permutation`, the permutation that HF `datasets.Dataset.shuffle(seed=seed)`
applies (datasets 5.2.0, `arrow_dataset.py::Dataset.shuffle`: `np.random.default_rng(seed)
.permutation(len(self))`), so the order matches the cookbook's `Gsm8kDataset(split="train", seed)`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from envs.types import Problem

VENDORED_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"
HF_DATASET_ID = "openai/gsm8k"
SPLITS = ("train", "test")


class DataIntegrityError(ValueError):
    """A data file does not match its recorded SHA-256."""


def seeded_permutation(n: int, seed: int) -> list[int]:
    """Row order of HF `Dataset.shuffle(seed=seed)` on n rows."""
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sha256sums(path: Path) -> dict[str, str]:
    """`sha256sum` format: '<hex>  <file name>' per line."""
    sums: dict[str, str] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64:
            raise DataIntegrityError(f"{path}:{lineno}: expected '<sha256>  <file>', got {line!r}")
        sums[parts[1].lstrip("*")] = parts[0].lower()
    return sums


def verify_sha256(data_file: Path, sums_file: Path) -> None:
    """DataIntegrityError unless `data_file`'s SHA-256 equals its entry in `sums_file`."""
    sums = read_sha256sums(sums_file)
    if data_file.name not in sums:
        raise DataIntegrityError(f"{sums_file} has no entry for {data_file.name}")
    got = _sha256_file(data_file)
    if got != sums[data_file.name]:
        raise DataIntegrityError(
            f"SHA-256 mismatch for {data_file}: expected {sums[data_file.name]} (from {sums_file}), got {got}; "
            f"the file was modified or corrupted")


def gold_answer(solution: str) -> str:
    """The final answer of a GSM8K solution (cookbook `extract_gsm8k_final_answer`)."""
    from tinker_cookbook.recipes.math_rl.math_env import extract_gsm8k_final_answer

    return extract_gsm8k_final_answer(solution)


def rows_to_problems(rows: Iterable[tuple[str, object]]) -> list[Problem]:
    """(location, record) pairs -> Problems indexed 0.. in order; ValueError naming the location
    of the first malformed record."""
    out: list[Problem] = []
    for where, rec in rows:
        if not isinstance(rec, dict):
            # ValueError like every other malformed-record error, so callers catch one type
            raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")  # noqa: TRY004
        for key in ("question", "answer"):
            if key not in rec:
                raise ValueError(f"{where}: missing key {key!r}")
            if not isinstance(rec[key], str) or not rec[key].strip():
                raise ValueError(f"{where}: {key!r} must be a non-empty string, got {rec[key]!r}")
        if "####" not in rec["answer"]:
            raise ValueError(f"{where}: answer has no '####' final-answer marker")
        gold = gold_answer(rec["answer"])
        if not gold:
            raise ValueError(f"{where}: empty final answer after '####'")
        out.append(Problem(index=len(out), question=rec["question"], answer=gold))
    return out


def _jsonl_records(path: Path) -> Iterator[tuple[str, object]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue  # tolerate blank lines (e.g. a trailing newline pair)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            yield f"{path}:{lineno}", rec


_cache: dict[tuple[str, int, int], list[Problem]] = {}


def read_jsonl(path: Path) -> list[Problem]:
    """Problems from a GSM8K-format jsonl file (keys question, answer), cached per file version."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _cache:
        _cache[key] = rows_to_problems(_jsonl_records(path))
    return list(_cache[key])


def load_split(source: str, split: str) -> list[Problem]:
    """One split from `source`: "vendored" (checked against SHA256SUMS), "openai/gsm8k" (HF hub,
    config "main"), or a folder holding <split>.jsonl (checked if it has a SHA256SUMS)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if source == HF_DATASET_ID:
        return _load_hf(split)
    folder = VENDORED_DIR if source == "vendored" else Path(source).expanduser()
    if not folder.is_dir():
        raise ValueError(f"env.source {source!r} is neither 'vendored', {HF_DATASET_ID!r} nor an existing folder")
    data_file = folder / f"{split}.jsonl"
    if not data_file.is_file():
        raise ValueError(f"env.source {source!r}: {data_file} does not exist")
    sums = folder / "SHA256SUMS"
    if source == "vendored" or sums.is_file():
        if not sums.is_file():
            raise DataIntegrityError(f"{sums} is missing; cannot verify the vendored GSM8K files")
        verify_sha256(data_file, sums)
    return read_jsonl(data_file)


def _load_hf(split: str) -> list[Problem]:
    from datasets import load_dataset

    try:
        ds = load_dataset(HF_DATASET_ID, "main", split=split)
    except Exception as e:  # offline, missing cache, ...
        raise ValueError(f"could not load {HF_DATASET_ID} (config main, split {split}) from the HF hub: {e}; "
                         f"env.source=vendored uses the copy shipped with envs") from e
    return rows_to_problems((f"{HF_DATASET_ID}[main/{split}] row {i}", dict(r)) for i, r in enumerate(ds))
