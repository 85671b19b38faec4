"""An aiohttp server speaking tinker 0.38's HTTP protocol, backed by the embedded engine.

Every operation is the engine's (`trainer.backends.local`), so a run through the real SDK and this
server computes what `backend=local` computes; what the wire adds is the SDK's own session, futures,
retry, protobuf and request-ordering code. Endpoints and body types follow the SDK's resources
(`tinker/resources/{service,models,training,weights,sampling,futures}.py`); bodies are parsed with the
SDK's request types, replies are its response types.

`TinkerServer` is the composition root: it authenticates each request, routes it to the handlers of
its resource and answers every refusal in the SDK's error shape. The state lives in two tables, each
with its own module: the registry of sessions, models, samplers and losses (`registry.py`) and the
futures table with its resend records and per-key work in flight (`futures.py`). The handlers parse,
call and serialize: sessions and models (`models.py`), training (`training.py`), sampling
(`sampling.py`), the REST management surface (`rest.py`, over `checkpoints.py` and `downloads.py`).

Access: every request carries the API key it was made with (`X-API-Key`). With `--api-key` only the
listed keys are accepted; without one the server answers loopback clients only (any `tml-` key,
which then only separates clients from each other). The key's digest owns every id the request
creates (`registry.py`).

Limits (`trainer.serve.limits`): body size per endpoint (413 before the body is read), and each size
and number a request names, checked before anything is queued.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from tinker import types

from trainer.serve import is_loopback
from trainer.serve.bodies import Bodies, digest
from trainer.serve.connections import GUARD, ConnectionGuard
from trainer.serve.faults import FaultPlan
from trainer.serve.futures import FutureTable
from trainer.serve.limits import SESSION_TIMEOUT_S, LimitExceeded, Limits
from trainer.serve.models import ModelRoutes
from trainer.serve.registry import Registry
from trainer.serve.replies import Refused, error_response
from trainer.serve.rest import RestSurface, add_rest_routes
from trainer.serve.sampling import SamplingRoutes
from trainer.serve.sessions import work_stats
from trainer.serve.training import TrainingRoutes

log = logging.getLogger("trainer.serve")


class TinkerServer:
    def __init__(self, engine: Any, faults: FaultPlan | None = None, poll_s: float = 20.0,
                 server_side_loss: bool = True, latency_s: float = 0.0, api_keys: Iterable[str] = (),
                 limits: Limits | None = None, allow_remote: bool = False, ttl_sweep_s: float = 60.0,
                 session_timeout_s: float = SESSION_TIMEOUT_S, read_timeout_s: float = 30.0):
        self.engine = engine
        self.allow_remote = allow_remote  # --insecure-allow-remote: any tml- key from anywhere
        self.faults = faults or FaultPlan()
        self.server_side_loss = server_side_loss
        self.latency_s = latency_s
        self.limits = limits or Limits()
        # the accepted keys, as digests (compared in constant time); empty = loopback clients, any tml- key
        self.api_keys = tuple(digest(k) for k in api_keys)
        keyless = not self.api_keys
        # requests per routed endpoint (benchmarks read them from /stats); never keyed by a path's text
        self.counts: dict[str, int] = {}
        self.lock = threading.RLock()  # FutureTable.once holds it while a request's future is registered
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="serve-load")
        self.bodies = Bodies(self.limits, read_timeout_s)
        self.futures = FutureTable(self.limits, self.lock, keyless, poll_s)
        # runs, checkpoints, sessions, downloads (trainer.serve.rest); told of each session, run and sampler
        self.rest = RestSurface(self, engine.state_dir, sweep_s=ttl_sweep_s)
        self.registry = Registry(engine, self.limits, self.lock, keyless, session_timeout_s, self.pool,
                                 self.futures, self.rest)
        self.models = ModelRoutes(self)
        self.training = TrainingRoutes(self)
        self.sampling = SamplingRoutes(self)
        self.connections = ConnectionGuard(self.limits)  # open connections, per-key requests in progress

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        # aiohttp's own cap is the largest per-endpoint limit; `Bodies.read` applies the endpoint's own
        app = web.Application(
            middlewares=[self._middleware, self.connections.middleware],
            client_max_size=max(self.limits.body_limit(e)[0] for e in ("forward_backward", "create_session")))
        app[GUARD] = self.connections
        r = app.router
        m, t, s = self.models, self.training, self.sampling
        post = {
            "client/config": m.client_config, "client/dynamic_config": m.dynamic_config,
            "create_session": m.create_session, "session_heartbeat": m.session_heartbeat,
            "telemetry": self.ok({"status": "accepted"}), "create_model": m.create_model,
            "get_info": m.get_info, "forward_backward": t.forward_backward, "optim_step": t.optim_step,
            "save_weights": t.save_weights, "save_weights_for_sampler": t.save_weights_for_sampler,
            "load_weights": m.load_weights, "create_sampling_session": s.create_sampling_session,
            "asample": s.asample, "retrieve_future": self.retrieve_future,
            "create_custom_loss": t.create_custom_loss, "sessions/{session_id}/finish": m.finish_session,
        }
        for path, handler in post.items():
            r.add_post(f"/api/v1/{path}", handler)
        r.add_get("/api/v1/healthz", self.ok({"status": "ok"}))
        r.add_get("/api/v1/get_server_capabilities", m.capabilities)
        r.add_get("/api/v1/samplers/{sampler_id}", s.get_sampler)
        r.add_get("/stats", self.stats)
        add_rest_routes(app, self.rest)
        app.on_startup.append(self.registry.start_expiry)
        app.on_cleanup.append(self.registry.stop_expiry)
        return app

    def _authorize(self, request: web.Request) -> str:
        """The owner (the key's digest) of a request, or Refused(401/403)."""
        key = request.headers.get("X-API-Key", "")
        if self.api_keys:
            d = digest(key)
            if not any(hmac.compare_digest(d, k) for k in self.api_keys):
                raise Refused(401, "invalid API key: this server accepts only the key(s) it was started with "
                                   "(--api-key, the lines of --api-key-file, $PAIREDRL_SERVE_API_KEY)")
            return d
        if not (self.allow_remote or is_loopback(request.remote)):
            raise Refused(403, "this server was started without --api-key and answers loopback clients only")
        if not key.startswith("tml-") or len(key) < 5:
            raise Refused(401, "invalid API key: a key of the form 'tml-<name>' is needed (without --api-key "
                               "the key only separates clients on this machine)")
        return digest(key)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        endpoint = request.path.removeprefix("/api/v1/")
        try:
            if request.path.startswith("/api/") or request.path == "/stats":
                request["owner"] = self._authorize(request)
            limit, flag = self.limits.body_limit(endpoint)
            if request.content_length is not None and request.content_length > limit:
                raise Refused(413, f"request body of {request.content_length} bytes exceeds this server's "
                                   f"limit of {limit} bytes for {endpoint} ({flag})")
            resource = request.match_info.route.resource
            name = resource.canonical.removeprefix("/api/v1/") if resource is not None else "(no route)"
            self.counts[name] = self.counts.get(name, 0) + 1
            if self.latency_s > 0 and endpoint not in ("telemetry", "session_heartbeat", "client/config",
                                                       "client/dynamic_config"):
                await asyncio.sleep(self.latency_s)
            kind = self.faults.draw(endpoint)
            if kind is None:
                return await handler(request)
            log.info("fault %s on %s", kind, endpoint)
            if kind in ("500", "429", "408", "410"):
                body = {"type": "try_again"} if kind == "408" else {"detail": f"injected fault {kind}"}
                return web.json_response(body, status=int(kind))
            request["fault"] = kind
            if kind == "delay":
                await asyncio.sleep(self.faults.delay_s)
            resp = await handler(request)
            if kind == "drop":  # the work was taken; the reply is lost with the connection
                if request.transport is not None:
                    request.transport.abort()
                raise asyncio.CancelledError()
            return resp
        except Refused as e:
            resp = error_response(e.status, e.detail)
            if request.get("close"):
                resp.force_close()
            return resp
        except LimitExceeded as e:
            return error_response(413, str(e))
        except ValueError as e:  # a check of the request's fields (limits.*) before any work
            return error_response(400, str(e))
        except web.HTTPException as e:
            if e.status == 404 and request.match_info.route.resource is None:
                return error_response(404, f"no endpoint {request.method} {request.path} on this server")
            if e.status == 413:
                return error_response(413, f"request body exceeds this server's limit for {endpoint}")
            if e.status == 405:
                return error_response(405, f"method {request.method} is not allowed on {request.path[:200]}")
            if e.status >= 400:
                return error_response(e.status, e.reason)
            raise

    @staticmethod
    def ok(body: Any) -> Callable:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(body)

        return handler

    async def retrieve_future(self, request: web.Request) -> web.Response:
        req, _ = await self.bodies.parse(request, types.FutureRetrieveRequest)
        expired = self.futures.expired_reply(req.request_id)
        if expired is not None:
            return expired
        pending = self.futures.pending(req.request_id, request["owner"])
        self.registry.touch(pending.session)
        return await self.futures.result(req.request_id, pending, request.get("fault"))

    async def stats(self, request: web.Request) -> web.Response:
        me, reg = request["owner"], self.registry
        return web.json_response({
            "requests": self.counts, "faults": self.faults.injected, "sessions": len(reg.sessions),
            "models": len(reg.models), "expired_sessions": reg.expired_sessions,
            "connections": self.connections.stats(),
            **work_stats(self.engine, self.futures.inflight, self.lock),
            "samplers": reg.sampler_slots.total(),
            "memory": self.engine.memory() if hasattr(self.engine, "memory") else {},
            "key": {"sessions": sum(1 for o in reg.sessions.values() if o == me),  # the asking key's own
                    "models": sum(1 for m in reg.models if reg.owner.get(m) == me),
                    "model_slots": len(reg.slots.get(me, ())), "inflight": self.futures.in_flight(me)}})
