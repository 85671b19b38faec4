"""Crash-safe file writing: atomic replace for state, flushed appends for logs."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable


def atomic_replace(path: str | Path, write: Callable[[str], None], suffix: str = ".tmp") -> None:
    """Call `write(tmp_path)` on a temp file beside `path`, then fsync + chmod 0644 + rename it over
    `path`, so readers never see a torn file. The temp file is removed if anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (see atomic_replace)."""
    atomic_replace(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: str | Path, what: str = "file") -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON (line {e.lineno}: {e.msg})") from None


class JsonlAppender:
    """Appends one JSON object per line and flushes + fsyncs each write."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, default=_json_default) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def read_jsonl_lenient(path: str | Path) -> tuple[list[dict], int]:
    """Read a JSONL log; a torn LAST line (killed mid-write) is dropped and counted.

    A malformed line anywhere else is corruption, not a torn write: raise naming the line."""
    path = Path(path)
    if not path.exists():
        return [], 0
    lines = path.read_text().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    rows: list[dict] = []
    torn = 0
    for i, line in enumerate(lines):
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            rows.append(obj)
        except ValueError:
            if i == len(lines) - 1:
                torn = 1
            else:
                raise ValueError(f"{path}:{i + 1}: malformed JSON line (not a torn last line); "
                                 "refusing to resume over a corrupt log") from None
    return rows, torn


def rewrite_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, default=_json_default) + "\n" for r in rows))
