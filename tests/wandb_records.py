"""Read an offline wandb run back: the records of its `.wandb` file, parsed with wandb's own protobuf.

wandb 0.31 writes the file from its Go core and ships no Python reader, so the block framing is decoded
here: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each with a
7-byte header (crc32 4 bytes, length 2 bytes, type 1 byte: 1 full, 2 first, 3 middle, 4 last) — the
LevelDB log layout. The payloads are `wandb.proto.wandb_internal_pb2.Record` messages.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_FILE_HEADER = 7
_REC_HEADER = 7


def records(path: str | Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb data file"
    out, pos, buf = [], _FILE_HEADER, b""
    while pos + _REC_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _REC_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _REC_HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left_in_block
            continue
        chunk = data[pos + _REC_HEADER:pos + _REC_HEADER + length]
        pos += _REC_HEADER + length
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


@dataclass
class OfflineRun:
    """What one offline run directory (wandb/offline-run-*) holds."""

    dir: Path
    run: Any = None
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: list[Any] = field(default_factory=list)

    def table(self, value: dict) -> list[dict]:
        """The rows of a logged wandb.Table (its history/summary value) as dicts."""
        t = json.loads((self.dir / "files" / value["path"]).read_text())
        return [dict(zip(t["columns"], row)) for row in t["data"]]


def _put(d: dict[str, Any], item: Any) -> None:
    """A value under its key, or under its nested key path (how wandb stores a table's fields)."""
    path = [item.key] if item.key else list(item.nested_key)
    for p in path[:-1]:
        d = d.setdefault(p, {})
    d[path[-1]] = json.loads(item.value_json)


def finished_records(path: Path, timeout_s: float = 30.0) -> list[Any]:
    """The records of a finished run's file, once its `exit` record is on disk. `wandb.finish()` hands the
    end of the run to wandb's service process and returns without waiting for it to flush the file, so a
    reader right after it (under load) can see the file without its last records."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            recs = records(path)
        except Exception:  # noqa: BLE001 - a record still being written: read again
            recs = []
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            assert recs, f"{path}: no readable wandb records after {timeout_s:g} s"
            return recs
        time.sleep(0.1)


def read_offline_run(run_dir: str | Path) -> OfflineRun:
    run_dir = Path(run_dir)
    (f,) = run_dir.glob("*.wandb")
    out = OfflineRun(run_dir)
    for r in finished_records(f):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.run = r.run
            for it in r.run.config.update:
                _put(out.config, it)
        elif kind == "config":
            for it in r.config.update:
                _put(out.config, it)
        elif kind == "history":
            row: dict[str, Any] = {}
            for it in r.history.item:
                _put(row, it)
            out.history.append(row)
        elif kind == "summary":
            for it in r.summary.update:
                _put(out.summary, it)
        elif kind == "metric":
            out.metrics.append(r.metric)
    return out


def offline_runs(folder: str | Path) -> list[OfflineRun]:
    """Every offline run under folder/wandb, oldest first (a resumed run adds one per start)."""
    return [read_offline_run(d) for d in sorted(Path(folder).glob("wandb/offline-run-*"))]
