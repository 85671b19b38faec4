"""External-weights exports and their signed download URLs.

`tinker checkpoint download` (`tinker/cli/commands/checkpoint.py::_download_checkpoint`) loads the
checkpoint into a new training client, saves it with `save_weights_external` (a PEFT LoRA folder,
`ckpt.write_peft`), asks for `external_weights_urls` and fetches each URL with plain `urllib` (no API key),
then deletes the export. The URLs point back at this server, `/files/...`, each signed with an HMAC (a
per-boot secret) over the file and an expiry, and name only the files of `ckpt.PEFT_FILES`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from aiohttp import web
from tinker import types

from trainer.backends.local import ckpt
from trainer.backends.local.common import CheckpointPathError, check_id, resolve_path
from trainer.serve.checkpoints import CheckpointStore, as_datetime, now
from trainer.serve.replies import Refused

MAX_TTL_S = 10 * 365 * 86400  # SaveWeightsExternalRequest.ttl_seconds: "1 hour (3600) to 10 years"
URL_TTL_S = 3600.0


class Downloads:
    def __init__(self, server: Any, store: CheckpointStore):
        self.s = server  # the TinkerServer: bodies, registry, training
        self.store = store
        self._secret = secrets.token_bytes(32)

    async def save_weights_external(self, request: web.Request) -> web.Response:
        """`TrainingClient.save_weights_external`: a training command like `save_weights` (the model's ordered
        worker, a future, de-duplicated resends), writing the PEFT export (`LocalTrainingClient.
        save_weights_external`)."""
        req, digest = await self.s.bodies.parse(request, types.SaveWeightsExternalRequest)
        self.s.registry.model(req.model_id, request["owner"])
        name = check_id(req.path, "external weights name") if isinstance(req.path, str) else None
        if name is None:
            raise Refused(400, "save_weights_external needs a name (path)")
        if req.ttl_seconds is not None and not 1 <= req.ttl_seconds <= MAX_TTL_S:
            raise Refused(400, f"ttl_seconds must be in [1, {MAX_TTL_S}], got {req.ttl_seconds}")
        return self.s.training.command(
            request, req.model_id, req.seq_id, digest, lambda tc: tc.save_weights_external(
                name, ttl_seconds=req.ttl_seconds, age_encryption_recipients=req.age_encryption_recipients))

    def _sign(self, run_id: str, name: str, file: str, exp: int) -> str:
        msg = f"{run_id}/{name}/{file}/{exp}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    async def external_weights_urls(self, request: web.Request) -> web.Response:
        _, kind, _, _ = self.store.owned_checkpoint(request.match_info, request["owner"])
        if kind != "external":
            raise Refused(400, "external_weights_urls takes an external_weights checkpoint")
        run_id, name = request.match_info["run_id"], request.match_info["name"]
        exp = int(now() + URL_TTL_S)
        origin = str(request.url.origin())
        urls = {f: f"{origin}/files/{run_id}/{name}/{f}?exp={exp}&sig={self._sign(run_id, name, f, exp)}"
                for f in ckpt.PEFT_FILES}
        return web.json_response(text=types.ExternalWeightsUrlsResponse(
            urls=urls, expires=as_datetime(exp)).model_dump_json())

    async def download_file(self, request: web.Request) -> web.StreamResponse:
        """One file of an external-weights checkpoint, for a URL `external_weights_urls` signed."""
        m = request.match_info
        run_id, name, file = m["run_id"], m["name"], m["file"]
        try:
            exp = int(request.query.get("exp", ""))
        except ValueError:
            raise Refused(403, "unsigned or malformed download URL") from None
        sig = request.query.get("sig", "")
        if (file not in ckpt.PEFT_FILES or exp < now()
                or not hmac.compare_digest(sig, self._sign(run_id, name, file, exp))):
            raise Refused(403, "download URL is not signed by this server or has expired")
        try:
            folder = resolve_path(f"tinker://{run_id}/external_weights/{name}", self.store.root,
                                  ("external",))
        except CheckpointPathError:
            raise Refused(404, "checkpoint not found") from None
        return web.FileResponse(folder / file)
