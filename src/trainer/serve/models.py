"""Handlers of the sessions and models resources (tinker 0.38 `resources/service.py`, `resources/models.py`,
and `load_weights` of `resources/weights.py`): parse the SDK's request, call the registry or the engine,
answer the SDK's response type. The state they change is the registry's (`registry.py`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from tinker import types

from trainer.serve.limits import check_lora, check_metadata, check_optimizer_config
from trainer.serve.replies import Refused, json_result


class ModelRoutes:
    def __init__(self, server: Any):
        self.s = server  # the TinkerServer: engine, limits, bodies, registry, futures, training, rest

    # ------------------------------------------------------------------ sessions
    async def client_config(self, request: web.Request) -> web.Response:
        cfg = types.ClientConfigResponse(pjwt_auth_enabled=False, use_pyqwest_transport=False,
                                         parallel_fwdbwd_chunks=False, proto_compress_fwdbwd=False,
                                         custom_loss_server_side=self.s.server_side_loss)
        return web.json_response(cfg.model_dump(mode="json"))

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response(types.ClientDynamicConfigResponse().model_dump(mode="json"))

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(self.s.engine.get_server_capabilities().model_dump(mode="json"))

    async def create_session(self, request: web.Request) -> web.Response:
        req, _ = await self.s.bodies.parse(request, types.CreateSessionRequest)
        check_metadata(req.user_metadata, self.s.limits)
        sid = self.s.registry.open_session(request["owner"])
        self.s.rest.on_session(sid, request["owner"], req.user_metadata)
        return web.json_response({"type": "create_session", "session_id": sid})

    async def session_heartbeat(self, request: web.Request) -> web.Response:
        """A live session's heartbeat; 410 for one this key does not hold (finished, or from before a
        restart), which is how the service tells the SDK to stop its heartbeat loop
        (tinker 0.38 `internal_client_holder.py::_session_heartbeat` returns on a 410)."""
        req, _ = await self.s.bodies.parse(request, types.SessionHeartbeatRequest)
        reg = self.s.registry
        if reg.sessions.get(req.session_id) != request["owner"]:
            raise Refused(410, f"session {str(req.session_id)[:100]} is finished or unknown on this server "
                               f"(a session ends {reg.session_timeout_s:g} s after its last heartbeat)")
        reg.touch(req.session_id)
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        """The session ends: its models, samplers and losses are dropped (frees the key's model slots) and
        nothing more is created under it (the SDK documents a finished session as terminal). Finishing a
        session this key does not hold is a no-op, as a client closing after a restart does."""
        sid = request.match_info["session_id"]
        if self.s.registry.sessions.get(sid) == request["owner"]:
            self.s.registry.end_session(sid)
        return web.json_response(None)

    # ------------------------------------------------------------------ models
    async def create_model(self, request: web.Request) -> web.Response:
        s, owner = self.s, request["owner"]
        req, digest = await s.bodies.parse(request, types.CreateModelRequest)
        model_id = f"{s.registry.session(req.session_id, owner)}:train:{req.model_seq_id}"
        lc = req.lora_config or types.LoraConfig(rank=32)
        check_lora(lc.rank, s.limits)
        check_metadata(req.user_metadata, s.limits)
        check_optimizer_config(req.optimizer_config)
        s.registry.reserve_model(owner, model_id)

        def create() -> types.CreateModelResponse:
            try:
                tc = s.engine.create_lora_training_client(
                    req.base_model, rank=lc.rank, seed=lc.seed, train_mlp=lc.train_mlp,
                    train_attn=lc.train_attn, train_unembed=lc.train_unembed, optimizer=req.optimizer_config,
                    run_id=model_id, user_metadata=req.user_metadata)
            except BaseException:
                s.registry.free_model(owner, model_id)
                raise
            s.registry.adopt(owner, model_id, tc)
            s.rest.on_run(model_id, owner, req.session_id, req.base_model, lc, req.user_metadata)
            return types.CreateModelResponse(model_id=model_id)

        return s.futures.once(owner, ("create", model_id), digest,
                              lambda: self._creating(owner, model_id, create))

    def _creating(self, owner: str, model_id: str, create: Any) -> dict:
        """A create's future, run on a loader thread; the model id is the key's from now on."""
        self.s.registry.owner[model_id] = owner
        return self.s.futures.register(owner, self.s.pool.submit(create), json_result, model_id=model_id)

    async def load_weights(self, request: web.Request) -> web.Response:
        s, owner = self.s, request["owner"]
        req, digest = await s.bodies.parse(request, types.LoadWeightsRequest)
        s.rest.check_load(req.path, owner)  # 4xx now for a path this key may not load
        if req.model_id is None:  # 0.38: a new training client created from a checkpoint
            if req.session_id is None or req.model_seq_id is None:
                raise Refused(400, "load_weights needs model_id, or session_id and model_seq_id")
            check_optimizer_config(req.optimizer_config)
            model_id = f"{s.registry.session(req.session_id, owner)}:train:{req.model_seq_id}"
            check_metadata(req.user_metadata, s.limits)
            s.registry.reserve_model(owner, model_id)
            make = (s.engine.create_training_client_from_state_with_optimizer if req.optimizer
                    else s.engine.create_training_client_from_state)

            def load() -> types.LoadWeightsResponse:
                try:
                    tc = make(req.path, run_id=model_id, user_metadata=req.user_metadata)
                except BaseException:
                    s.registry.free_model(owner, model_id)
                    raise
                s.registry.adopt(owner, model_id, tc)
                s.rest.on_run(model_id, owner, req.session_id, tc.base_model, types.LoraConfig(
                    rank=tc.rank, train_mlp=tc.trains("mlp"), train_attn=tc.trains("attn"),
                    train_unembed=tc.trains("unembed")), req.user_metadata, source_path=req.path)
                return types.LoadWeightsResponse(path=req.path, model_id=model_id)

            return s.futures.once(owner, ("create", model_id), digest,
                                  lambda: self._creating(owner, model_id, load))
        s.registry.model(req.model_id, owner)

        def submit(tc: Any) -> Any:
            return tc.load_state_with_optimizer(req.path) if req.optimizer else tc.load_state(req.path)

        return s.training.command(request, req.model_id, req.seq_id, digest, submit)

    async def get_info(self, request: web.Request) -> web.Response:
        req, _ = await self.s.bodies.parse(request, types.GetInfoRequest)
        info = self.s.registry.model(req.model_id, request["owner"]).get_info()
        return web.json_response(info.model_copy(update={"model_id": req.model_id}).model_dump(
            mode="json", exclude_none=True))
