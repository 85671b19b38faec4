"""The Tinker REST (management) surface: training runs, checkpoints, sessions, external-weights downloads.

Routes and bodies are the ones tinker 0.38's `RestClient` (`tinker/lib/public_interfaces/rest_client.py`)
and `AsyncWeightsResource` (`tinker/resources/weights.py`) send; replies are the SDK's own response types
(`types.TrainingRun`, `TrainingRunsResponse`, `Checkpoint`, `CheckpointsListResponse`, `WeightsInfoResponse`,
`ListSessionsResponse`, `GetSessionResponse`, `ExternalWeightsUrlsResponse`), so the SDK parses every reply.
A checkpoint id is `<weights|sampler_weights|external_weights>/<name>` (the SDK's
`ParsedCheckpointTinkerPath.checkpoint_id`), sent unescaped in the URL, hence the two-segment routes.

The handlers here parse and answer; runs and checkpoints on disk are `checkpoints.CheckpointStore`'s, the
exports and their signed URLs `downloads.Downloads`'. Sessions are per boot: this module keeps each one's
listing (metadata, samplers) for `list_sessions` / `get_session`, including ended ones up to the per-key
session cap. A run, its checkpoints and a session answer only to the key that created them (`owner` is
always the requesting key's digest, `request["owner"]`, set by the server's middleware).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from tinker import types

from trainer.serve.checkpoints import CheckpointStore, as_datetime, now
from trainer.serve.downloads import MAX_TTL_S, Downloads
from trainer.serve.replies import Refused

MAX_LIMIT = 1000  # the most items one listing page returns


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
    """The management endpoints over one server's state dir. The server calls the `on_*` hooks as it
    creates sessions, training runs and samplers, and `check_load` before a checkpoint path is loaded."""

    def __init__(self, server: Any, state_dir: Path, sweep_s: float = 60.0):
        self.store = CheckpointStore(state_dir, sweep_s)
        self.downloads = Downloads(server, self.store)
        self.server = server  # its `bodies` read the JSON bodies here
        self.sessions: dict[str, _Session] = {}
        self.on_run = self.store.on_run
        self.check_load = self.store.check_load

    def on_session(self, session_id: str, owner: str, user_metadata: dict[str, Any] | None = None) -> None:
        meta = {str(k): str(v) for k, v in (user_metadata or {}).items()} or None
        self.sessions[session_id] = _Session(owner, now(), meta)

    def on_sampler(self, sampler_id: str, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is not None and sampler_id not in s.samplers:
            s.samplers.append(sampler_id)

    def prune_sessions(self, owner: str, live: set[str], keep: int) -> None:
        """Ended sessions stay listed up to `keep` per key, newest first."""
        ended = sorted((s.created_at, i) for i, s in self.sessions.items()
                       if s.owner == owner and i not in live)
        for _, i in ended[:max(0, len(ended) - keep)]:
            del self.sessions[i]

    def _training_run(self, rec: dict[str, Any]) -> types.TrainingRun:
        cks = self.store.checkpoints(rec)
        last = {kind: next((c for c in reversed(cks) if c.checkpoint_type == kind), None)
                for kind in ("training", "sampler")}
        latest = max([rec["created_at"]] + [c.time.timestamp() for c in cks])
        return types.TrainingRun(
            training_run_id=rec["training_run_id"], base_model=rec["base_model"],
            model_owner=rec["owner"][:16],
            is_lora=True, lora_rank=rec["lora_rank"], last_request_time=as_datetime(latest),
            last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"],
            user_metadata=rec.get("user_metadata"))

    # ------------------------------------------------------------------ training runs
    async def list_training_runs(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 20, 1, MAX_LIMIT)
        offset = _int_param(request, "offset", 0, 0, 2**31)
        scope = _scope(request)
        me = request["owner"]
        recs = [r for r in self.store.records()
                if r["owner"] == me or (scope == "accessible" and self.store.any_public(r))]
        recs.sort(key=lambda r: (-r["created_at"], r["training_run_id"]))
        page = [self._training_run(r) for r in recs[offset:offset + limit]]
        body = types.TrainingRunsResponse(training_runs=page, cursor=types.Cursor(
            offset=offset, limit=limit, total_count=len(recs)))
        return web.json_response(text=body.model_dump_json())

    async def get_training_run(self, request: web.Request) -> web.Response:
        rec = self.store.run(request.match_info["run_id"], request["owner"], _scope(request))
        return web.json_response(text=self._training_run(rec).model_dump_json())

    # ------------------------------------------------------------------ checkpoints
    async def list_checkpoints(self, request: web.Request) -> web.Response:
        rec = self.store.run(request.match_info["run_id"], request["owner"])
        return web.json_response(text=types.CheckpointsListResponse(
            checkpoints=self.store.checkpoints(rec)).model_dump_json())

    async def list_user_checkpoints(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 100, 1, MAX_LIMIT)
        offset = _int_param(request, "offset", 0, 0, 2**31)
        me = request["owner"]
        cks = [c for r in self.store.records() if r["owner"] == me for c in self.store.checkpoints(r)]
        cks.sort(key=lambda c: (c.time, c.tinker_path), reverse=True)
        return web.json_response(text=types.CheckpointsListResponse(
            checkpoints=cks[offset:offset + limit],
            cursor=types.Cursor(offset=offset, limit=limit, total_count=len(cks))).model_dump_json())

    async def weights_info(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await self.server.bodies.read(request))
            path = body["tinker_path"]
        except (ValueError, KeyError, TypeError):
            raise Refused(400, 'weights_info needs a JSON body {"tinker_path": ...}') from None
        folder = self.store.check_load(path, request["owner"])
        meta = json.loads((folder / "meta.json").read_text())
        targets = set(meta["targets"])
        return web.json_response(text=types.WeightsInfoResponse(
            base_model=meta["base_model"], is_lora=True, lora_rank=int(meta["rank"]),
            train_unembed="lm_head" in targets,
            train_mlp=bool(targets & {"gate_proj", "up_proj", "down_proj"}),
            train_attn=bool(targets & {"q_proj", "k_proj", "v_proj", "o_proj"})).model_dump_json())

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        rec, _, cid, folder = self.store.owned_checkpoint(request.match_info, request["owner"])
        self.store.delete_folder(folder)
        self.store.forget_checkpoint(rec, cid)
        return web.Response(status=204)

    async def set_ttl(self, request: web.Request) -> web.Response:
        rec, _, cid, _ = self.store.owned_checkpoint(request.match_info, request["owner"])
        try:
            ttl = json.loads(await self.server.bodies.read(request))["ttl_seconds"]
        except (ValueError, KeyError, TypeError):
            raise Refused(400, 'set_checkpoint_ttl needs a JSON body {"ttl_seconds": int | null}') from None
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)
                                or not 1 <= ttl <= MAX_TTL_S):
            raise Refused(400, f"ttl_seconds must be null or an integer in [1, {MAX_TTL_S}], got {ttl!r}")
        self.store.update_checkpoint(rec, cid, expires_at=None if ttl is None else now() + ttl)
        return web.Response(status=204)

    async def publish(self, request: web.Request) -> web.Response:
        rec, _, cid, _ = self.store.owned_checkpoint(request.match_info, request["owner"])
        self.store.update_checkpoint(rec, cid, public=request.method == "POST")
        return web.Response(status=204)

    # ------------------------------------------------------------------ sessions
    def _session(self, request: web.Request) -> tuple[str, _Session]:
        sid = request.match_info["session_id"]
        s = self.sessions.get(sid)
        if s is None or s.owner != request["owner"]:
            raise Refused(404, f"session {sid[:200]!r} not found")
        return sid, s

    async def list_sessions(self, request: web.Request) -> web.Response:
        limit = _int_param(request, "limit", 20, 1, MAX_LIMIT)
        offset = _int_param(request, "offset", 0, 0, 2**31)
        _scope(request)
        me = request["owner"]
        mine = sorted(((s.created_at, sid) for sid, s in self.sessions.items() if s.owner == me),
                      reverse=True)
        return web.json_response(text=types.ListSessionsResponse(
            sessions=[sid for _, sid in mine[offset:offset + limit]]).model_dump_json())

    async def get_session(self, request: web.Request) -> web.Response:
        sid, s = self._session(request)
        runs = sorted((r["created_at"], r["training_run_id"]) for r in self.store.records()
                      if r.get("session_id") == sid and r["owner"] == s.owner)
        return web.json_response(text=types.GetSessionResponse(
            training_run_ids=[rid for _, rid in runs], sampler_ids=list(s.samplers),
            user_metadata=s.user_metadata).model_dump_json())

    @staticmethod
    def refused(reason: str) -> Any:
        """A call this server does not offer: 400 with why. Not 501: the SDK retries every 5xx for up to
        five minutes (`lib/internal_client_holder.py::_is_retryable_status_code`, `execute_with_retries`)."""
        async def handler(request: web.Request) -> web.Response:
            raise Refused(400, f"not offered by this offline server: {reason}")

        return handler


#: SDK 0.38 calls this server refuses (400) and why (each also a row of docs/tinker.md's table)
REFUSED = {
    ("POST", "/api/v1/sessions/search"):
        "session search is a hosted-service feature (no search index offline)",
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): "session traces are not recorded offline",
    ("PUT", "/api/v1/sessions/{session_id}/project"): "projects are a hosted-service feature",
    ("POST", "/api/v1/copy_weights"):
        "projects are a hosted-service feature (copy_weights copies between them)",
    ("GET", "/api/v1/audit"): "no audit log is kept offline",
    ("GET", "/api/v1/billing/usage/events"): "billing is a hosted-service feature",
    ("GET", "/api/v1/billing/usage/checkpoints/current"): "billing is a hosted-service feature",
}


def add_rest_routes(app: web.Application, rest: RestSurface) -> None:
    """Register the management routes and the TTL sweeper on `app`."""
    r, dl = app.router, rest.downloads
    run = "/api/v1/training_runs/{run_id}"
    ck = run + "/checkpoints/{segment}/{name}"
    r.add_get("/api/v1/training_runs", rest.list_training_runs)
    r.add_get(run, rest.get_training_run)
    r.add_get(run + "/checkpoints", rest.list_checkpoints)
    r.add_delete(ck, rest.delete_checkpoint)
    r.add_put(ck + "/ttl", rest.set_ttl)
    r.add_post(ck + "/publish", rest.publish)
    r.add_delete(ck + "/publish", rest.publish)
    r.add_get(ck + "/external_weights_urls", dl.external_weights_urls)
    r.add_get("/api/v1/checkpoints", rest.list_user_checkpoints)
    r.add_post("/api/v1/weights_info", rest.weights_info)
    r.add_post("/api/v1/save_weights_external", dl.save_weights_external)
    r.add_get("/api/v1/sessions", rest.list_sessions)
    r.add_get("/api/v1/sessions/{session_id}", rest.get_session)
    r.add_get("/files/{run_id}/{name}/{file}", dl.download_file)
    for (method, path), reason in REFUSED.items():
        r.add_route(method, path, rest.refused(reason))
    app.on_startup.append(rest.store.start_sweeper)
    app.on_cleanup.append(rest.store.stop_sweeper)
