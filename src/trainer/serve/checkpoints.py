"""Training runs and their checkpoints on disk, under one server's state dir: run records, listings, load
permission and the TTL sweeper.

A run is the folder `<state dir>/<run_id>/` (`run_id` = the model id the server handed out); its `run.json`
records the create call (base model, LoRA config, `user_metadata`, session), the creating key's SHA-256
digest (never the key) and per-checkpoint settings changed later (TTL, published). Checkpoints are the
engine's folders `<run_id>/<segment>/<name>/` with their `meta.json` (`trainer.backends.local.ckpt`); both
survive a restart on the same `--state-dir`. A folder without `run.json` has no owner and is not listed.

Checkpoints are immutable: the engine writes each one whole, aside, and swaps it in (`ckpt._atomic_folder`;
a taken training-state name is refused without `overwrite`), and nothing here edits a checkpoint's files:
only its record's settings change, or the whole folder goes (renamed aside first, so a listing never sees
half of it). A run and its checkpoints answer only to their key (another key gets the unknown-id 404); a
published checkpoint can also be read by other keys. A checkpoint expires at its save's `ttl_seconds` or
what `set_checkpoint_ttl` set later; listings never show it and the sweeper deletes it every `sweep_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web
from tinker import types

from trainer.backends.local.common import (
    SEGMENTS,
    CheckpointPathError,
    check_id,
    resolve_path,
)
from trainer.serve.replies import Refused

log = logging.getLogger("trainer.serve.rest")
_KIND_OF_SEGMENT = {v: k for k, v in SEGMENTS.items()}


def now() -> float:
    return time.time()


def as_datetime(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


class CheckpointStore:
    """The run records and checkpoint folders under `state_dir`."""

    def __init__(self, state_dir: Path, sweep_s: float = 60.0):
        self.root = Path(state_dir).expanduser().resolve()
        self.sweep_s = float(sweep_s)
        self.runs: dict[str, dict[str, Any]] = {}  # run_id -> run.json, loaded from disk at start
        # runs are recorded from the server's loader threads and swept from an executor thread while the
        # event loop reads them: every change to a record, and its serialization, holds this lock
        self._lock = threading.Lock()
        self._sweeper: asyncio.Task | None = None
        self.deleted_by_ttl = 0
        self._load_runs()

    # ------------------------------------------------------------------ run records
    def _load_runs(self) -> None:
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            f = d / "run.json"
            if d.is_dir() and not d.name.startswith(".") and f.is_file():
                try:
                    rec = json.loads(f.read_text())
                    if rec.get("training_run_id") == d.name and isinstance(rec.get("owner"), str):
                        self.runs[d.name] = rec
                except (OSError, ValueError):
                    log.warning("ignoring unreadable run record %s", f)

    def _write_run(self, rec: dict[str, Any]) -> None:
        folder = self.root / rec["training_run_id"]
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".run.json.{secrets.token_hex(4)}"
        with self._lock:
            text = json.dumps(rec, indent=1)
        tmp.write_text(text)
        os.replace(tmp, folder / "run.json")

    def on_run(self, run_id: str, owner: str, session_id: str, base_model: str, lora: types.LoraConfig | None,
               user_metadata: dict[str, Any] | None, source_path: str | None = None) -> None:
        """Record a training run (`create_model`, or `load_weights` creating a client from a checkpoint)."""
        check_id(run_id, "run id")
        lora = lora or types.LoraConfig(rank=32)
        rec = {"training_run_id": run_id, "owner": owner, "session_id": session_id,
               "base_model": base_model, "is_lora": True, "lora_rank": lora.rank, "train_mlp": lora.train_mlp,
               "train_attn": lora.train_attn, "train_unembed": lora.train_unembed,
               "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
               "created_at": now(), "source_path": source_path, "checkpoints": {}}
        with self._lock:
            self.runs[run_id] = rec
        self._write_run(rec)

    # ------------------------------------------------------------------ lookups
    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.runs.values())

    def update_checkpoint(self, rec: dict[str, Any], cid: str, **values: Any) -> None:
        """Change a checkpoint's recorded settings (TTL, published) and write run.json."""
        with self._lock:
            rec.setdefault("checkpoints", {}).setdefault(cid, {}).update(values)
        self._write_run(rec)

    def forget_checkpoint(self, rec: dict[str, Any] | None, cid: str) -> None:
        if rec is None:
            return
        with self._lock:
            gone = rec.get("checkpoints", {}).pop(cid, None)
        if gone is not None:
            self._write_run(rec)

    def run(self, run_id: str, owner: str, scope: str = "owned") -> dict[str, Any]:
        rec = self.runs.get(run_id)
        if rec is not None and (rec["owner"] == owner
                                or (scope == "accessible" and self.any_public(rec))):
            return rec
        raise Refused(404, f"training run {run_id[:200]!r} not found")

    def any_public(self, rec: dict[str, Any]) -> bool:
        with self._lock:
            return any(c.get("public") for c in rec.get("checkpoints", {}).values())

    def folders(self, run_id: str) -> list[tuple[str, Path]]:
        out = []
        for kind, seg in SEGMENTS.items():
            d = self.root / run_id / seg
            if d.is_dir():
                out += [(kind, f) for f in d.iterdir()
                        if not f.name.startswith(".") and not f.is_symlink() and (f / "meta.json").is_file()]
        return out

    def expires_at(self, rec: dict[str, Any] | None, cid: str, meta: dict[str, Any]) -> float | None:
        over = (rec or {}).get("checkpoints", {}).get(cid, {})
        return over["expires_at"] if "expires_at" in over else meta.get("expires_at")

    def checkpoint(self, rec: dict[str, Any], kind: str, folder: Path) -> types.Checkpoint | None:
        try:
            meta = json.loads((folder / "meta.json").read_text())
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        except (OSError, ValueError):  # deleted or being replaced right now
            return None
        cid = f"{SEGMENTS[kind]}/{folder.name}"
        expires = self.expires_at(rec, cid, meta)
        if expires is not None and expires <= now():
            return None
        created = meta.get("created_at") or (folder / "meta.json").stat().st_mtime
        return types.Checkpoint(
            checkpoint_id=cid, checkpoint_type=kind, time=as_datetime(created),
            tinker_path=f"tinker://{rec['training_run_id']}/{cid}", size_bytes=size,
            public=bool(rec.get("checkpoints", {}).get(cid, {}).get("public", False)),
            user_metadata=meta.get("checkpoint_user_metadata") or None,
            expires_at=as_datetime(expires) if expires is not None else None)

    def checkpoints(self, rec: dict[str, Any]) -> list[types.Checkpoint]:
        out = [c for kind, f in self.folders(rec["training_run_id"]) if (c := self.checkpoint(rec, kind, f))]
        return sorted(out, key=lambda c: (c.time, c.checkpoint_id))

    def _parse(self, run_id: str, segment: str, name: str) -> tuple[str, str]:
        """(kind, checkpoint_id) of a route's checkpoint id; 404 for a segment that is none of the SDK's."""
        kind = _KIND_OF_SEGMENT.get(segment)
        try:
            check_id(run_id, "run id")
            check_id(name, "checkpoint name")
        except ValueError:
            kind = None
        if kind is None:
            raise Refused(404, f"checkpoint {segment[:50]}/{name[:200]} not found")
        return kind, f"{segment}/{name}"

    def owned_checkpoint(self, m: Any, owner: str) -> tuple[dict[str, Any], str, str, Path]:
        """(run record, kind, checkpoint id, folder) of a route's checkpoint, if `owner`'s; else 404."""
        kind, cid = self._parse(m["run_id"], m["segment"], m["name"])
        rec = self.run(m["run_id"], owner)
        folder = self.root / m["run_id"] / cid
        if not ((folder / "meta.json").is_file() and not folder.is_symlink()
                and self.checkpoint(rec, kind, folder) is not None):
            raise Refused(404, f"checkpoint tinker://{m['run_id']}/{cid} not found")
        return rec, kind, cid, folder

    def check_load(self, path: Any, owner: str) -> Path:
        """The folder a load names, if this key may load it: its own run's, a published checkpoint, or one
        in a run folder with no owner recorded. Anything else is the same 404 a missing checkpoint gets;
        a malformed path is a 400. Confinement to the state dir is `resolve_path`'s."""
        try:
            folder = resolve_path(path, self.root)
        except CheckpointPathError as e:
            raise Refused(e.status, str(e)) from None
        run_id = folder.parent.parent.name
        rec = self.runs.get(run_id)
        if rec is None:
            return folder
        cid = f"{folder.parent.name}/{folder.name}"
        meta = json.loads((folder / "meta.json").read_text())
        expires = self.expires_at(rec, cid, meta)
        public = rec.get("checkpoints", {}).get(cid, {}).get("public", False)
        if (rec["owner"] != owner and not public) or (expires is not None and expires <= now()):
            raise Refused(404, f"no checkpoint {str(path)[:200]!r} on this server")
        return folder

    def delete_folder(self, folder: Path) -> None:
        aside = folder.parent / f".deleted.{folder.name}.{secrets.token_hex(4)}"
        os.replace(folder, aside)  # listings skip dot-names: the checkpoint is gone at once
        shutil.rmtree(aside, ignore_errors=True)

    # ------------------------------------------------------------------ TTL sweeper
    def sweep(self) -> int:
        """Delete every expired checkpoint under the state dir; returns how many."""
        n = 0
        if not self.root.is_dir():
            return 0
        for run_dir in self.root.iterdir():
            if run_dir.name.startswith(".") or not run_dir.is_dir() or run_dir.is_symlink():
                continue
            with self._lock:
                rec = self.runs.get(run_dir.name)
            for _, folder in self.folders(run_dir.name):
                try:
                    meta = json.loads((folder / "meta.json").read_text())
                except (OSError, ValueError):
                    continue
                cid = f"{folder.parent.name}/{folder.name}"
                expires = self.expires_at(rec, cid, meta)
                if expires is not None and expires <= now():
                    with contextlib.suppress(OSError):
                        self.delete_folder(folder)
                        n += 1
                        self.forget_checkpoint(rec, cid)
        self.deleted_by_ttl += n
        return n

    async def _sweep_forever(self) -> None:
        while True:
            try:
                n = await asyncio.get_running_loop().run_in_executor(None, self.sweep)
                if n:
                    log.info("TTL sweeper deleted %d expired checkpoint(s)", n)
            except Exception:  # the sweeper must outlive one bad folder
                log.exception("TTL sweep failed")
            await asyncio.sleep(self.sweep_s)

    async def start_sweeper(self, app: web.Application) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop_sweeper(self, app: web.Application) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

