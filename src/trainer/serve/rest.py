"""The Tinker REST (management) surface: training runs, checkpoints, sessions, external-weights downloads.

Routes and bodies are the ones tinker 0.38's `RestClient` (`tinker/lib/public_interfaces/rest_client.py`)
and `AsyncWeightsResource` (`tinker/resources/weights.py`) send; replies are the SDK's own response types
(`types.TrainingRun`, `TrainingRunsResponse`, `Checkpoint`, `CheckpointsListResponse`, `WeightsInfoResponse`,
`ListSessionsResponse`, `GetSessionResponse`, `ExternalWeightsUrlsResponse`), so the SDK parses every reply.
A checkpoint id is `<weights|sampler_weights|external_weights>/<name>` (the SDK's
`ParsedCheckpointTinkerPath.checkpoint_id`), sent unescaped in the URL, hence the two-segment routes.

Where things live: a training run is the folder `<state dir>/<run_id>/` (`run_id` = the training model id the
server handed out); `run.json` in it records the run as the create call described it (base model, LoRA
config, `user_metadata`, session), the key that created it (as a SHA-256 digest, never the key) and the
per-checkpoint settings changed later (TTL, published). The checkpoints are the engine's folders
`<run_id>/<segment>/<name>/` with their `meta.json` (`trainer.backends.local.ckpt`). Both survive a restart
on the same `--state-dir`; sessions are per boot.

Ownership: a run, its checkpoints and a session answer only to the key that created them; any other key
gets the 404 an unknown id gets (so ids cannot be probed). A published checkpoint can also be read
(weights info, load) by other keys: that is what `publish` records. A run folder without `run.json`
(written by the in-process engine, or before run records existed) has no owner and is not listed.

TTL: a checkpoint's `expires_at` is its save call's `ttl_seconds` (kept in `meta.json`), or what
`set_checkpoint_ttl` set later; a sweeper deletes expired checkpoints every `sweep_s` seconds, and listings
never show an expired one. Deleting renames the folder aside first, so a listing never sees half of it.

Downloads: `tinker checkpoint download` (`tinker/cli/commands/checkpoint.py::_download_checkpoint`) loads
the checkpoint into a new training client, saves it with `save_weights_external` (a PEFT LoRA folder,
`ckpt.write_peft`), asks for `external_weights_urls` and fetches each URL with plain `urllib` (no API
key), then deletes the export. The URLs point back at this server, `/files/...`, each signed with an
HMAC (a per-boot secret) over the file and an expiry, and name only the files of `ckpt.PEFT_FILES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aiohttp import web
from tinker import types

from trainer.backends.local import ckpt
from trainer.backends.local.common import (
    SEGMENTS,
    CheckpointPathError,
    check_id,
    resolve_path,
)
from trainer.serve.replies import Refused, json_result

log = logging.getLogger("trainer.serve.rest")
_KIND_OF_SEGMENT = {v: k for k, v in SEGMENTS.items()}
MAX_LIMIT = 1000  # the most items one listing page returns
MAX_TTL_S = 10 * 365 * 86400  # SaveWeightsExternalRequest.ttl_seconds: "1 hour (3600) to 10 years"
URL_TTL_S = 3600.0


def _now() -> float:
    return time.time()


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def _request_key(request: web.Request) -> str:
    """The requesting key's owner digest, which the server's middleware sets on every `/api/` request
    (`TinkerServer._authorize`); run.json stores this digest, never the key."""
    return request["owner"]


def _int_param(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise Refused(400, f"query parameter {name} must be an integer, got {raw[:50]!r}") from None
    if not lo <= v <= hi:
        raise Refused(400, f"query parameter {name} must be in [{lo}, {hi}], got {v}")
    return v


def _scope(request: web.Request) -> str:
    scope = request.query.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise Refused(400, f"access_scope must be 'owned' or 'accessible', got {scope[:50]!r}")
    return scope


@dataclass
class _Session:
    owner: str
    created_at: float
    user_metadata: dict[str, str] | None
    samplers: list[str] = field(default_factory=list)


class RestSurface:
    """The management endpoints over one server's state dir. `TinkerServer` calls the `on_*` hooks as it
    creates sessions, training runs and samplers, and `check_load` before a checkpoint path is loaded;
    `owner` is always the requesting key's digest (`request["owner"]`)."""

    def __init__(self, server: Any, state_dir: Path, sweep_s: float = 60.0):
        self.server = server  # the TinkerServer whose request helpers save_weights_external uses
        self.root = Path(state_dir).expanduser().resolve()
        self.sweep_s = float(sweep_s)
        self.sessions: dict[str, _Session] = {}
        self.runs: dict[str, dict[str, Any]] = {}  # run_id -> run.json, loaded from disk at start
        # runs are recorded from the server's loader threads and swept from an executor thread while the
        # event loop reads them: every change to a record, and its serialization, holds this lock
        self._lock = threading.Lock()
        self._secret = secrets.token_bytes(32)
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

    def on_session(self, session_id: str, owner: str, user_metadata: dict[str, Any] | None = None) -> None:
        self.sessions[session_id] = _Session(owner, _now(),
                                             {str(k): str(v) for k, v in (user_metadata or {}).items()} or None)

    def on_sampler(self, sampler_id: str, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is not None and sampler_id not in s.samplers:
            s.samplers.append(sampler_id)

    def on_run(self, run_id: str, owner: str, session_id: str, base_model: str, lora: types.LoraConfig | None,
               user_metadata: dict[str, Any] | None, source_path: str | None = None) -> None:
        """Record a training run (`create_model`, or `load_weights` creating a client from a checkpoint)."""
        check_id(run_id, "run id")
        lora = lora or types.LoraConfig(rank=32)
        rec = {"training_run_id": run_id, "owner": owner, "session_id": session_id,
               "base_model": base_model, "is_lora": True, "lora_rank": lora.rank, "train_mlp": lora.train_mlp,
               "train_attn": lora.train_attn, "train_unembed": lora.train_unembed,
               "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
               "created_at": _now(), "source_path": source_path, "checkpoints": {}}
        with self._lock:
            self.runs[run_id] = rec
        self._write_run(rec)

    # ------------------------------------------------------------------ lookups
    def _records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.runs.values())

    def _set(self, rec: dict[str, Any], cid: str, **values: Any) -> None:
        """Change a checkpoint's recorded settings (TTL, published) and write run.json."""
        with self._lock:
            rec.setdefault("checkpoints", {}).setdefault(cid, {}).update(values)
        self._write_run(rec)

    def _forget(self, rec: dict[str, Any] | None, cid: str) -> None:
        if rec is None:
            return
        with self._lock:
            gone = rec.get("checkpoints", {}).pop(cid, None)
        if gone is not None:
            self._write_run(rec)

    def _run(self, run_id: str, owner: str, scope: str = "owned") -> dict[str, Any]:
        rec = self.runs.get(run_id)
        if rec is not None and (rec["owner"] == owner
                                or (scope == "accessible" and self._any_public(rec))):
            return rec
        raise Refused(404, f"training run {run_id[:200]!r} not found")

    def _any_public(self, rec: dict[str, Any]) -> bool:
        with self._lock:
            return any(c.get("public") for c in rec.get("checkpoints", {}).values())

    def _folders(self, run_id: str) -> list[tuple[str, Path]]:
        out = []
        for kind, seg in SEGMENTS.items():
            d = self.root / run_id / seg
            if d.is_dir():
                out += [(kind, f) for f in d.iterdir()
                        if not f.name.startswith(".") and not f.is_symlink() and (f / "meta.json").is_file()]
        return out

    def _expires_at(self, rec: dict[str, Any] | None, cid: str, meta: dict[str, Any]) -> float | None:
        over = (rec or {}).get("checkpoints", {}).get(cid, {})
        return over["expires_at"] if "expires_at" in over else meta.get("expires_at")

    def _checkpoint(self, rec: dict[str, Any], kind: str, folder: Path) -> types.Checkpoint | None:
        try:
            meta = json.loads((folder / "meta.json").read_text())
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        except (OSError, ValueError):  # deleted or being replaced right now
            return None
        cid = f"{SEGMENTS[kind]}/{folder.name}"
        expires = self._expires_at(rec, cid, meta)
        if expires is not None and expires <= _now():
            return None
        created = meta.get("created_at") or (folder / "meta.json").stat().st_mtime
        return types.Checkpoint(
            checkpoint_id=cid, checkpoint_type=kind, time=_dt(created),
            tinker_path=f"tinker://{rec['training_run_id']}/{cid}", size_bytes=size,
            public=bool(rec.get("checkpoints", {}).get(cid, {}).get("public", False)),
            user_metadata=meta.get("checkpoint_user_metadata") or None,
            expires_at=_dt(expires) if expires is not None else None)

    def _checkpoints(self, rec: dict[str, Any]) -> list[types.Checkpoint]:
        out = [c for kind, f in self._folders(rec["training_run_id"]) if (c := self._checkpoint(rec, kind, f))]
        return sorted(out, key=lambda c: (c.time, c.checkpoint_id))

    def _training_run(self, rec: dict[str, Any]) -> types.TrainingRun:
        cks = self._checkpoints(rec)
        last = {kind: next((c for c in reversed(cks) if c.checkpoint_type == kind), None)
                for kind in ("training", "sampler")}
        latest = max([rec["created_at"]] + [c.time.timestamp() for c in cks])
        return types.TrainingRun(
            training_run_id=rec["training_run_id"], base_model=rec["base_model"], model_owner=rec["owner"][:16],
            is_lora=True, lora_rank=rec["lora_rank"], last_request_time=_dt(latest),
            last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"],
            user_metadata=rec.get("user_metadata"))

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

    def _owned_checkpoint(self, request: web.Request) -> tuple[dict[str, Any], str, str, Path]:
        m = request.match_info
        kind, cid = self._parse(m["run_id"], m["segment"], m["name"])
        rec = self._run(m["run_id"], _request_key(request))
        folder = self.root / m["run_id"] / cid
        if not ((folder / "meta.json").is_file() and not folder.is_symlink()
                and self._checkpoint(rec, kind, folder) is not None):
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
        expires = self._expires_at(rec, cid, meta)
        public = rec.get("checkpoints", {}).get(cid, {}).get("public", False)
        if (rec["owner"] != owner and not public) or (expires is not None and expires <= _now()):
            raise Refused(404, f"no checkpoint {str(path)[:200]!r} on this server")
        return folder

    # ------------------------------------------------------------------ training runs
    async def list_training_runs(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 20, 1, MAX_LIMIT)
        offset = _int_param(request, "offset", 0, 0, 2**31)
        scope = _scope(request)
        me = _request_key(request)
        recs = [r for r in self._records() if r["owner"] == me or (scope == "accessible" and self._any_public(r))]
        recs.sort(key=lambda r: (-r["created_at"], r["training_run_id"]))
        page = [self._training_run(r) for r in recs[offset:offset + limit]]
        body = types.TrainingRunsResponse(training_runs=page, cursor=types.Cursor(
            offset=offset, limit=limit, total_count=len(recs)))
        return web.json_response(text=body.model_dump_json())

    async def get_training_run(self, request: web.Request) -> web.Response:
        rec = self._run(request.match_info["run_id"], _request_key(request), _scope(request))
        return web.json_response(text=self._training_run(rec).model_dump_json())

    # ------------------------------------------------------------------ checkpoints
    async def list_checkpoints(self, request: web.Request) -> web.Response:
        rec = self._run(request.match_info["run_id"], _request_key(request))
        return web.json_response(text=types.CheckpointsListResponse(
            checkpoints=self._checkpoints(rec)).model_dump_json())

    async def list_user_checkpoints(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 100, 1, MAX_LIMIT)
        offset = _int_param(request, "offset", 0, 0, 2**31)
        me = _request_key(request)
        cks = [c for r in self._records() if r["owner"] == me for c in self._checkpoints(r)]
        cks.sort(key=lambda c: (c.time, c.tinker_path), reverse=True)
        return web.json_response(text=types.CheckpointsListResponse(
            checkpoints=cks[offset:offset + limit],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(cks))).model_dump_json())

    async def weights_info(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await self.server._read(request))
            path = body["tinker_path"]
        except (ValueError, KeyError, TypeError):
            raise Refused(400, 'weights_info needs a JSON body {"tinker_path": ...}') from None
        folder = self.check_load(path, _request_key(request))
        meta = json.loads((folder / "meta.json").read_text())
        targets = set(meta["targets"])
        return web.json_response(text=types.WeightsInfoResponse(
            base_model=meta["base_model"], is_lora=True, lora_rank=int(meta["rank"]),
            train_unembed="lm_head" in targets, train_mlp=bool(targets & {"gate_proj", "up_proj", "down_proj"}),
            train_attn=bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"})).model_dump_json())

    def _delete_folder(self, folder: Path) -> None:
        aside = folder.parent / f".deleted.{folder.name}.{secrets.token_hex(4)}"
        os.replace(folder, aside)  # listings skip dot-names: the checkpoint is gone at once
        shutil.rmtree(aside, ignore_errors=True)

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        rec, _, cid, folder = self._owned_checkpoint(request)
        self._delete_folder(folder)
        self._forget(rec, cid)
        return web.Response(status=204)

    async def set_ttl(self, request: web.Request) -> web.Response:
        rec, _, cid, _ = self._owned_checkpoint(request)
        try:
            ttl = json.loads(await self.server._read(request))["ttl_seconds"]
        except (ValueError, KeyError, TypeError):
            raise Refused(400, 'set_checkpoint_ttl needs a JSON body {"ttl_seconds": int | null}') from None
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL_S):
            raise Refused(400, f"ttl_seconds must be null or an integer in [1, {MAX_TTL_S}], got {ttl!r}")
        self._set(rec, cid, expires_at=None if ttl is None else _now() + ttl)
        return web.Response(status=204)

    async def publish(self, request: web.Request) -> web.Response:
        rec, _, cid, _ = self._owned_checkpoint(request)
        self._set(rec, cid, public=request.method == "POST")
        return web.Response(status=204)

    # ------------------------------------------------------------------ external weights
    async def save_weights_external(self, request: web.Request) -> web.Response:
        """`TrainingClient.save_weights_external`: a training request like `save_weights` (the model's ordered
        worker, a future, de-duplicated resends), writing the PEFT export (`LocalTrainingClient.
        save_weights_external`)."""
        server = self.server
        req, digest = await server._body(request, types.SaveWeightsExternalRequest)
        server._model(req.model_id, request)
        name = check_id(req.path, "external weights name") if isinstance(req.path, str) else None
        if name is None:
            raise Refused(400, "save_weights_external needs a name (path)")
        if req.ttl_seconds is not None and not 1 <= req.ttl_seconds <= MAX_TTL_S:
            raise Refused(400, f"ttl_seconds must be in [1, {MAX_TTL_S}], got {req.ttl_seconds}")
        return server._once(request, ("train", req.model_id, req.seq_id), digest, lambda: server._register(
            request, server._train(req.model_id, request, lambda tc: tc.save_weights_external(
                name, ttl_seconds=req.ttl_seconds, age_encryption_recipients=req.age_encryption_recipients)),
            json_result, model_id=req.model_id))

    def _sign(self, run_id: str, name: str, file: str, exp: int) -> str:
        msg = f"{run_id}/{name}/{file}/{exp}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    async def external_weights_urls(self, request: web.Request) -> web.Response:
        rec, kind, _, _ = self._owned_checkpoint(request)
        if kind != "external":
            raise Refused(400, "external_weights_urls takes an external_weights checkpoint")
        run_id, name = request.match_info["run_id"], request.match_info["name"]
        exp = int(_now() + URL_TTL_S)
        origin = str(request.url.origin())
        urls = {f: f"{origin}/files/{run_id}/{name}/{f}?exp={exp}&sig={self._sign(run_id, name, f, exp)}"
                for f in ckpt.PEFT_FILES}
        return web.json_response(text=types.ExternalWeightsUrlsResponse(urls=urls, expires=_dt(exp)).model_dump_json())

    async def download_file(self, request: web.Request) -> web.StreamResponse:
        """One file of an external-weights checkpoint, for a URL `external_weights_urls` signed."""
        m = request.match_info
        run_id, name, file = m["run_id"], m["name"], m["file"]
        try:
            exp = int(request.query.get("exp", ""))
        except ValueError:
            raise Refused(403, "unsigned or malformed download URL") from None
        sig = request.query.get("sig", "")
        if (file not in ckpt.PEFT_FILES or exp < _now()
                or not hmac.compare_digest(sig, self._sign(run_id, name, file, exp))):
            raise Refused(403, "download URL is not signed by this server or has expired")
        try:
            folder = resolve_path(f"tinker://{run_id}/external_weights/{name}", self.root, ("external",))
        except CheckpointPathError:
            raise Refused(404, "checkpoint not found") from None
        return web.FileResponse(folder / file)

    # ------------------------------------------------------------------ sessions
    def _session(self, request: web.Request) -> tuple[str, _Session]:
        sid = request.match_info["session_id"]
        s = self.sessions.get(sid)
        if s is None or s.owner != _request_key(request):
            raise Refused(404, f"session {sid[:200]!r} not found")
        return sid, s

    async def list_sessions(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 20, 1, MAX_LIMIT)
        offset = _int_param(request, "offset", 0, 0, 2**31)
        _scope(request)
        me = _request_key(request)
        mine = sorted(((s.created_at, sid) for sid, s in self.sessions.items() if s.owner == me), reverse=True)
        return web.json_response(text=types.ListSessionsResponse(
            sessions=[sid for _, sid in mine[offset:offset + limit]]).model_dump_json())

    async def get_session(self, request: web.Request) -> web.Response:
        sid, s = self._session(request)
        runs = sorted((r["created_at"], r["training_run_id"]) for r in self._records()
                      if r.get("session_id") == sid and r["owner"] == s.owner)
        return web.json_response(text=types.GetSessionResponse(
            training_run_ids=[rid for _, rid in runs], sampler_ids=list(s.samplers),
            user_metadata=s.user_metadata).model_dump_json())

    # ------------------------------------------------------------------ refused
    @staticmethod
    def refused(reason: str) -> Any:
        """A call this server does not offer: 400 with why. Not 501: the SDK retries every 5xx for up to
        five minutes (`lib/internal_client_holder.py::_is_retryable_status_code`, `execute_with_retries`)."""
        async def handler(request: web.Request) -> web.Response:
            raise Refused(400, f"not offered by this offline server: {reason}")

        return handler

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
            for _, folder in self._folders(run_dir.name):
                try:
                    meta = json.loads((folder / "meta.json").read_text())
                except (OSError, ValueError):
                    continue
                cid = f"{folder.parent.name}/{folder.name}"
                expires = self._expires_at(rec, cid, meta)
                if expires is not None and expires <= _now():
                    with contextlib.suppress(OSError):
                        self._delete_folder(folder)
                        n += 1
                        self._forget(rec, cid)
        self.deleted_by_ttl += n
        return n

    async def _sweep_forever(self) -> None:
        while True:
            try:
                n = await asyncio.get_running_loop().run_in_executor(None, self.sweep)
                if n:
                    log.info("TTL sweeper deleted %d expired checkpoint(s)", n)
            except Exception:  # noqa: BLE001 - the sweeper must outlive one bad folder
                log.exception("TTL sweep failed")
            await asyncio.sleep(self.sweep_s)

    async def _start(self, app: web.Application) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _stop(self, app: web.Application) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper


#: SDK 0.38 calls this server refuses (400) and why (each also a row of docs/tinker.md's table)
REFUSED = {
    ("POST", "/api/v1/sessions/search"): "session search is a hosted-service feature (no search index offline)",
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): "session traces are not recorded offline",
    ("PUT", "/api/v1/sessions/{session_id}/project"): "projects are a hosted-service feature",
    ("POST", "/api/v1/copy_weights"): "projects are a hosted-service feature (copy_weights copies between them)",
    ("GET", "/api/v1/audit"): "no audit log is kept offline",
    ("GET", "/api/v1/billing/usage/events"): "billing is a hosted-service feature",
    ("GET", "/api/v1/billing/usage/checkpoints/current"): "billing is a hosted-service feature",
}


def add_rest_routes(app: web.Application, rest: RestSurface) -> None:
    """Register the management routes and the TTL sweeper on `app`."""
    r = app.router
    run = "/api/v1/training_runs/{run_id}"
    ck = run + "/checkpoints/{segment}/{name}"
    r.add_get("/api/v1/training_runs", rest.list_training_runs)
    r.add_get(run, rest.get_training_run)
    r.add_get(run + "/checkpoints", rest.list_checkpoints)
    r.add_delete(ck, rest.delete_checkpoint)
    r.add_put(ck + "/ttl", rest.set_ttl)
    r.add_post(ck + "/publish", rest.publish)
    r.add_delete(ck + "/publish", rest.publish)
    r.add_get(ck + "/external_weights_urls", rest.external_weights_urls)
    r.add_get("/api/v1/checkpoints", rest.list_user_checkpoints)
    r.add_post("/api/v1/weights_info", rest.weights_info)
    r.add_post("/api/v1/save_weights_external", rest.save_weights_external)
    r.add_get("/api/v1/sessions", rest.list_sessions)
    r.add_get("/api/v1/sessions/{session_id}", rest.get_session)
    r.add_get("/files/{run_id}/{name}/{file}", rest.download_file)
    for (method, path), reason in REFUSED.items():
        r.add_route(method, path, rest.refused(reason))
    app.on_startup.append(rest._start)
    app.on_cleanup.append(rest._stop)
