"""An aiohttp server speaking tinker 0.38's HTTP protocol, backed by the embedded engine.

Every operation is the engine's (`trainer.backends.local`), so a run through the real SDK and this
server computes what `backend=local` computes; what the wire adds is the SDK's own session, futures,
retry, protobuf and request-ordering code. Endpoints and body types follow the SDK's resources
(`tinker/resources/{service,models,training,weights,sampling,futures}.py`); bodies are parsed with the
SDK's request types, replies are its response types.

Ordering: the SDK sends a training client's requests one at a time in `seq_id` order (client config
`parallel_fwdbwd_chunks=false`; `training_client.py::_take_turn` waits for the previous POST), so
handing each one to the engine's per-client ordered worker inside its POST handler keeps that order.
A resend of a request the server already took (a reply lost to a dropped connection or a timeout) is
answered with the first one's future, by `(model_id, seq_id)`, so it is never applied twice.

Access: every request carries the API key it was made with (`X-API-Key`). With `--api-key` only the
listed keys are accepted; without one the server answers loopback clients only (any `tml-` key,
which then only separates clients from each other). Every id handed out (session, model, sampler,
loss, future) is random per boot and bound to the key that created it: another key is answered 404,
the same answer as for an id that never existed, so ids cannot be probed. Sessions, models,
samplers and losses are only created under a session this boot issued to the same key.

De-duplication of resends is keyed by `(key, model or session, seq_id)` and checks a digest of the
body: an identical resend gets the first reply; a different request with a taken `seq_id` is refused
(409, marked not to be retried), so one request can never receive another's future. The one field the
SDK changes on a resend, a sampler save's `sampling_session_seq_id`, is left out of that digest.

Limits (`trainer.serve.limits`): body size per endpoint (413 before the body is read), and each size
and number a request names, checked before anything is queued; a `forward_backward` protobuf is
decoded off the event loop, after the model id it names (read from the first bytes) is checked.

Futures: each accepted request gets an id; `retrieve_future` long-polls it for up to `poll_s` seconds
(under the SDK's 45 s read timeout) and answers `{"type": "try_again"}` while it runs, the result
(JSON, or protobuf for forward/backward and sampling), or `{"error", "category"}` when it failed:
category `user` for a request the engine refused (ValueError), `server` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web
from pydantic import ValidationError
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs

from trainer.serve import is_loopback
from trainer.serve.connections import GUARD, ConnectionGuard, read_body
from trainer.serve.faults import FaultPlan
from trainer.serve.graph_cost import CostExceeded, check_at_upload, check_request
from trainer.serve.limits import (
    SESSION_TIMEOUT_S,
    LimitExceeded,
    Limits,
    check_adam,
    check_batch,
    check_checkpoint_name,
    check_lora,
    check_loss_fn,
    check_metadata,
    check_optimizer_config,
    check_sample,
    check_text_only,
)
from trainer.serve.replies import Refused, error_response, json_result
from trainer.serve.rest import RestSurface, add_rest_routes
from trainer.serve.samplers import KEYLESS_NOTE, SamplerSlots
from trainer.serve.sessions import stop_work, work_stats
from trainer.serve.wire import (
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
    peek_model_id,
    rebuild_graph,
)
from trainer.utils.futures import then

log = logging.getLogger("trainer.serve")
PROTO = "application/x-protobuf"
# results kept for retrieval; beyond this the oldest finished quarter expires (HTTP 410 when asked again)
MAX_FUTURES = 50_000


class ModelLost(RuntimeError):
    """The model was dropped by an injected `poison` fault; its requests fail from then on."""


@dataclass
class _Pending:
    future: Future
    encode: Callable[[Any], tuple[bytes, str]]
    session: str  # released with its session (finished or expired)


# tinker's StableReinforce needs per-sequence information the service records at sampling time
# (`record_stability_info=True`); its docs (tinker-docs "Losses > StableReinforce", alpha) describe what a
# client sends but not the objective or what is recorded, and neither the SDK 0.38 (`types/loss_fn_type.py`,
# `types/sample_request.py`) nor tinker-cookbook 0.6.1 (`rl/train.py`, which only names the loss) defines
# them, so the engine cannot reproduce it and refuses it with the workaround. The one parameter the SDK does
# define, `kl_coeff`, travels in `loss_fn_config` (`types/forward_backward_input.py`), which
# `proto/request_conv.py` sends as `loss_fn_config_v2`.
STABLE_REINFORCE_REFUSAL = (
    "loss_fn 'stable_reinforce' is not implemented by this server: its objective needs stability information "
    "the service records when sampling, which no public source defines (the SDK's loss_fn_config_v2 only "
    "adds its kl_coeff); use loss_fn='importance_sampling' (tinker-cookbook: loss_fn=importance_sampling), "
    "or ppo / cispo")


class _Inflight:
    """An `inflight` sampling session: it samples with the latest weights its model published inflight.

    A sample already queued keeps the snapshot it was given (the SDK's contract lets a generation span
    updates and promises only "the weights saved when the client was created, or newer")."""

    def __init__(self, model_id: str, current: Any):
        self.model_id = model_id
        self.current = current

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)


def _fb(out: types.ForwardBackwardOutput) -> tuple[bytes, str]:
    return encode_forward_backward_output(out), PROTO


def _sample(resp: types.SampleResponse) -> tuple[bytes, str]:
    return encode_sample_response(resp), PROTO


def _shape(td: types.TensorData, dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    shape = tuple(td.shape) if td.shape is not None else (len(td.data),)
    return shape, dtype or (torch.int64 if td.dtype == "int64" else torch.float32)


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f


def _session_of(ident: str) -> str:
    """The session an id was created under (`s-<hex>:train:N`, `s-<hex>:sample:N`, `s-<hex>:loss:N`)."""
    return ident.split(":")[0]


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


class TinkerServer:
    def __init__(self, engine: Any, faults: FaultPlan | None = None, poll_s: float = 20.0,
                 server_side_loss: bool = True, latency_s: float = 0.0, api_keys: Iterable[str] = (),
                 limits: Limits | None = None, allow_remote: bool = False, ttl_sweep_s: float = 60.0,
                 session_timeout_s: float = SESSION_TIMEOUT_S, read_timeout_s: float = 30.0):
        self.engine = engine
        self.allow_remote = allow_remote  # --insecure-allow-remote: any tml- key from anywhere
        self.faults = faults or FaultPlan()
        self.poll_s = poll_s
        self.server_side_loss = server_side_loss
        self.latency_s = latency_s
        self.limits = limits or Limits()
        # the accepted keys, as digests (compared in constant time); empty = loopback clients, any tml- key
        self.api_keys = tuple(_digest(k) for k in api_keys)
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.owner: dict[str, str] = {}  # model / sampler / loss / future id -> owner (the key's digest)
        self.models: dict[str, Any] = {}
        self.poisoned: set[str] = set()
        self.samplers: dict[str, Any] = {}
        self.losses: dict[str, LossHandle] = {}
        self.futures: dict[str, _Pending] = {}
        self.expired: dict[str, None] = {}  # ids of released futures (410), oldest first
        self.session_timeout_s = session_timeout_s
        self.read_timeout_s = read_timeout_s
        self.last_seen: dict[str, float] = {}  # session id -> monotonic time of its last heartbeat or use
        self.expired_sessions = 0
        self.slots: dict[str, set[str]] = {}  # owner -> model ids reserved (created or being created)
        self.inflight: dict[str, int] = {}  # owner -> accepted requests whose future is not done
        self.taken: dict[tuple, tuple[str, dict]] = {}  # (owner, kind, id, seq) -> (body digest, reply given)
        # requests per routed endpoint (benchmarks read them from /stats); never keyed by a path's text
        self.counts: dict[str, int] = {}
        self._lock = threading.RLock()  # _once holds it while make() registers the future
        self.sampler_slots = SamplerSlots(self.limits, self._lock, keyless=not self.api_keys)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="serve-load")
        # runs, checkpoints, sessions, downloads (trainer.serve.rest); told of each session, run and sampler
        self.rest = RestSurface(self, engine.state_dir, sweep_s=ttl_sweep_s)
        self.connections = ConnectionGuard(self.limits)  # open connections, per-key requests in progress

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        # aiohttp's own cap is the largest per-endpoint limit; `_read` applies the endpoint's own
        app = web.Application(middlewares=[self._middleware, self.connections.middleware], client_max_size=max(
            self.limits.body_limit(e)[0] for e in ("forward_backward", "create_session")))
        app[GUARD] = self.connections
        r = app.router
        post = {
            "client/config": self.client_config, "client/dynamic_config": self.dynamic_config,
            "create_session": self.create_session, "session_heartbeat": self.session_heartbeat,
            "telemetry": self.ok({"status": "accepted"}), "create_model": self.create_model,
            "get_info": self.get_info, "forward_backward": self.forward_backward, "optim_step": self.optim_step,
            "save_weights": self.save_weights, "save_weights_for_sampler": self.save_weights_for_sampler,
            "load_weights": self.load_weights, "create_sampling_session": self.create_sampling_session,
            "asample": self.asample, "retrieve_future": self.retrieve_future,
            "create_custom_loss": self.create_custom_loss, "sessions/{session_id}/finish": self.finish_session,
        }
        for path, handler in post.items():
            r.add_post(f"/api/v1/{path}", handler)
        r.add_get("/api/v1/healthz", self.ok({"status": "ok"}))
        r.add_get("/api/v1/get_server_capabilities", self.capabilities)
        r.add_get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        r.add_get("/stats", self.stats)
        add_rest_routes(app, self.rest)
        app.on_startup.append(self._start_expiry)
        app.on_cleanup.append(self._stop_expiry)
        return app

    def _authorize(self, request: web.Request) -> str:
        """The owner (the key's digest) of a request, or Refused(401/403)."""
        key = request.headers.get("X-API-Key", "")
        if self.api_keys:
            d = _digest(key)
            if not any(hmac.compare_digest(d, k) for k in self.api_keys):
                raise Refused(401, "invalid API key: this server accepts only the key(s) it was started with "
                                   "(--api-key, the lines of --api-key-file, $PAIREDRL_SERVE_API_KEY)")
            return d
        if not (self.allow_remote or is_loopback(request.remote)):
            raise Refused(403, "this server was started without --api-key and answers loopback clients only")
        if not key.startswith("tml-") or len(key) < 5:
            raise Refused(401, "invalid API key: a key of the form 'tml-<name>' is needed (without --api-key the "
                               "key only separates clients on this machine)")
        return _digest(key)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        endpoint = request.path.removeprefix("/api/v1/")
        try:
            if request.path.startswith("/api/") or request.path == "/stats":
                request["owner"] = self._authorize(request)
            limit, flag = self.limits.body_limit(endpoint)
            if request.content_length is not None and request.content_length > limit:
                raise Refused(413, f"request body of {request.content_length} bytes exceeds this server's limit of "
                                   f"{limit} bytes for {endpoint} ({flag})")
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

    async def stats(self, request: web.Request) -> web.Response:
        me = request["owner"]
        return web.json_response({
            "requests": self.counts, "faults": self.faults.injected, "sessions": len(self.sessions),
            "models": len(self.models), "expired_sessions": self.expired_sessions,
            "connections": self.connections.stats(),
            **work_stats(self.engine, self.inflight, self._lock),
            "samplers": self.sampler_slots.total(),
            "memory": self.engine.memory() if hasattr(self.engine, "memory") else {},
            "key": {"sessions": sum(1 for o in self.sessions.values() if o == me),  # the asking key's own
                    "models": sum(1 for m in self.models if self.owner.get(m) == me),
                    "model_slots": len(self.slots.get(me, ())), "inflight": self.inflight.get(me, 0)}})

    # ------------------------------------------------------------------ helpers
    def _register(self, request: web.Request, future: Future, encode: Callable[[Any], tuple[bytes, str]],
                  **extra: Any) -> dict:
        rid = f"req-{secrets.token_hex(12)}"
        owner = request["owner"]
        session = _session_of(str(extra.get("model_id") or extra.get("session") or ""))
        extra.pop("session", None)
        self.futures[rid] = _Pending(future, encode, session)
        self.owner[rid] = owner
        with self._lock:  # released by the done callback, from whichever thread finishes the future
            self.inflight[owner] = self.inflight.get(owner, 0) + 1
        future.add_done_callback(lambda _: self._release_inflight(owner))
        if len(self.futures) > MAX_FUTURES:  # the oldest finished results expire, as promises do on the service
            for old in [k for k, p in itertools.islice(self.futures.items(), len(self.futures) // 4)
                        if p.future.done()]:
                self._forget_future(old)
            if len(self.taken) > 2 * MAX_FUTURES:
                for k in list(itertools.islice(self.taken, len(self.taken) // 2)):
                    del self.taken[k]
        return {"request_id": rid, **{k: v for k, v in extra.items() if v is not None}}

    def _release_inflight(self, owner: str) -> None:
        with self._lock:
            self.inflight[owner] -= 1
            if not self.inflight[owner]:
                del self.inflight[owner]

    def _forget_future(self, rid: str) -> None:
        """Drop a future's result; asking for it again is answered 410 (expired), as on the service."""
        self.futures.pop(rid, None)
        self.owner.pop(rid, None)
        self.expired[rid] = None
        if len(self.expired) > 4 * MAX_FUTURES:
            for k in list(itertools.islice(self.expired, len(self.expired) // 2)):
                del self.expired[k]

    def _once(self, request: web.Request, key: tuple, digest: str, make: Callable[[], dict]) -> web.Response:
        """The future reply of a request; a resend of the same request gets the first reply again, and a
        different request under a key already taken is refused. A new request past the key's in-flight
        bound is answered 429, which the SDK retries with backoff (`_base_client.py::_should_retry`)."""
        owner = request["owner"]
        key = (owner, *key)
        with self._lock:
            seen = self.taken.get(key)
            if seen is None:
                busy = self.inflight.get(owner, 0)
                if busy >= self.limits.inflight_per_key:
                    raise Refused(429, f"this key has {busy} requests in flight, this server's limit "
                                       f"({Limits.flag('inflight_per_key')}); retry when some have finished")
                busy = sum(self.inflight.values())
                if busy >= self.limits.inflight:
                    raise Refused(429, f"this server has {busy} requests in flight, its limit "
                                       f"({Limits.flag('inflight')}); retry when some have finished"
                                       f"{self._keyless_note()}")
                reply = make()
                self.taken[key] = (digest, reply)
                return web.json_response(reply)
        if seen[0] != digest:
            raise Refused(409, f"{key[1]} request {key[2:]} was already taken with a different body; a resend must "
                               "be identical, and a new request needs a new seq_id")
        return web.json_response(seen[1])

    def _owned(self, table: dict[str, Any], ident: str | None, request: web.Request, what: str) -> Any:
        """`table[ident]` when this request's key created it; otherwise the same 404 as an unknown id."""
        obj = table.get(ident or "")
        if obj is None or self.owner.get(ident or "") != request["owner"]:
            raise Refused(404, f"unknown {what} {str(ident)[:100]}")
        self._touch(_session_of(ident))
        return obj

    def _touch(self, session_id: str) -> None:
        """A session in use is alive (besides its heartbeats, which a raw-HTTP client may not send)."""
        if session_id in self.last_seen:
            self.last_seen[session_id] = time.monotonic()

    def _session(self, session_id: str | None, request: web.Request) -> str:
        """A session this boot issued to the request's key (ids from another boot or key are refused)."""
        if not session_id or self.sessions.get(session_id) != request["owner"]:
            raise Refused(404, f"unknown session_id {str(session_id)[:100]}: create a session on this "
                               "server first (ids from before a restart, or of a session that expired or was "
                               "finished, are not valid)")
        self._touch(session_id)
        return session_id

    def _model(self, model_id: str, request: web.Request) -> Any:
        return self._owned(self.models, model_id, request, "model_id")

    def _train(self, model_id: str, request: web.Request, submit: Callable[[Any], Any]) -> Future:
        """Hand a training request to the model's ordered worker (or fail it if the model was lost)."""
        tc = self._model(model_id, request)
        if request.get("fault") == "poison":
            self.poisoned.add(model_id)
        if model_id in self.poisoned:
            return _failed(ModelLost(f"model {model_id} was lost on the server (injected poison fault); "
                                     "create a new training client from a checkpoint"))
        try:
            out = submit(tc)
            return out if isinstance(out, Future) else out.future()
        except ValueError as e:
            return _failed(e)

    def _in_thread(self, fn: Callable[[], Any]) -> Future:
        return self._pool.submit(fn)

    async def _read(self, request: web.Request) -> bytes:
        """The body, up to the endpoint's limit and at the minimum rate (`connections.read_body`)."""
        limit, flag = self.limits.body_limit(request.path.removeprefix("/api/v1/"))
        return await read_body(request, limit, flag, self.read_timeout_s)

    async def _body(self, request: web.Request, cls: Any) -> tuple[Any, str]:
        """The request parsed with the SDK's type, and a digest of it for de-duplication."""
        raw = await self._read(request)
        try:
            return cls.model_validate_json(raw), _digest(raw)
        except ValidationError as e:  # one line per field, as every other refusal
            why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                            for err in e.errors()[:5])
            raise Refused(400, f"bad {cls.__name__}: {why[:300]}") from None
        except Exception as e:  # noqa: BLE001 - a malformed body is the client's fault
            raise Refused(400, f"bad {cls.__name__}: {' '.join(str(e).split())[:300]}") from None

    def _new_model_slot(self, request: web.Request, model_id: str) -> None:
        """Reserve one of the key's model slots at submission (a create still running holds its slot, so
        concurrent creates cannot pass the limit together); freed when the session ends or the create
        fails."""
        with self._lock:
            mine = self.slots.setdefault(request["owner"], set())
            if model_id not in mine and len(mine) >= self.limits.models_per_key:
                raise LimitExceeded(f"this key already has {len(mine)} live models, this server's limit "
                                    f"({Limits.flag('models_per_key')}); finish a session to free its models "
                                    "(a session whose heartbeats stop ends after "
                                    f"{self.session_timeout_s:g} s)")
            total = sum(len(v) for v in self.slots.values())
            if model_id not in mine and total >= self.limits.models:
                if not mine:
                    del self.slots[request["owner"]]
                raise LimitExceeded(f"this server already has {total} live models, its limit "
                                    f"({Limits.flag('models')}); a session's models are freed when it ends"
                                    f"{self._keyless_note()}")
            mine.add(model_id)

    def _keyless_note(self) -> str:
        """Said with a server-wide refusal when any `tml-` key is accepted (`samplers.KEYLESS_NOTE`)."""
        return "" if self.api_keys else f"; {KEYLESS_NOTE}"

    def _free_slot(self, owner: str, model_id: str) -> None:
        with self._lock:
            mine = self.slots.get(owner, set())
            mine.discard(model_id)
            if not mine:
                self.slots.pop(owner, None)

    def _adopt(self, owner: str, model_id: str, tc: Any) -> None:
        """Publish a model made on a loader thread, unless its session ended meanwhile (then it is closed
        and its slot freed: a finish or an expiry during a create leaks nothing)."""
        with self._lock:
            alive = self.sessions.get(_session_of(model_id)) == owner
            if alive:
                self.models[model_id] = tc
        if not alive:
            if hasattr(tc, "close"):
                tc.close()
            self._free_slot(owner, model_id)
            raise ValueError(f"session {_session_of(model_id)} ended while model {model_id} was being "
                             "created")

    # ------------------------------------------------------------------ session
    async def client_config(self, request: web.Request) -> web.Response:
        cfg = types.ClientConfigResponse(pjwt_auth_enabled=False, use_pyqwest_transport=False,
                                         parallel_fwdbwd_chunks=False, proto_compress_fwdbwd=False,
                                         custom_loss_server_side=self.server_side_loss)
        return web.json_response(cfg.model_dump(mode="json"))

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response(types.ClientDynamicConfigResponse().model_dump(mode="json"))

    async def create_session(self, request: web.Request) -> web.Response:
        req, _ = await self._body(request, types.CreateSessionRequest)
        owner = request["owner"]
        check_metadata(req.user_metadata, self.limits)
        sid = f"s-{secrets.token_hex(12)}"
        with self._lock:
            live = sum(1 for o in self.sessions.values() if o == owner)
            if live >= self.limits.sessions_per_key:
                raise LimitExceeded(f"this key already has {live} live sessions, this server's limit "
                                    f"({Limits.flag('sessions_per_key')}); close a ServiceClient, or wait "
                                    f"{self.session_timeout_s:g} s for those whose heartbeats stopped to "
                                    "expire")
            if len(self.sessions) >= self.limits.sessions:
                raise LimitExceeded(f"this server already has {len(self.sessions)} live sessions, its limit "
                                    f"({Limits.flag('sessions')}); a session whose heartbeats stop ends after "
                                    f"{self.session_timeout_s:g} s{self._keyless_note()}")
            self.sessions[sid] = owner
            self.last_seen[sid] = time.monotonic()
        self.rest.on_session(sid, owner, req.user_metadata)
        return web.json_response({"type": "create_session", "session_id": sid})

    async def session_heartbeat(self, request: web.Request) -> web.Response:
        """A live session's heartbeat; 410 for one this key does not hold (finished, or from before a
        restart), which is how the service tells the SDK to stop its heartbeat loop
        (tinker 0.38 `internal_client_holder.py::_session_heartbeat` returns on a 410)."""
        req, _ = await self._body(request, types.SessionHeartbeatRequest)
        if self.sessions.get(req.session_id) != request["owner"]:
            raise Refused(410, f"session {str(req.session_id)[:100]} is finished or unknown on this server "
                               f"(a session ends {self.session_timeout_s:g} s after its last heartbeat)")
        self._touch(req.session_id)
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        """The session ends: its models, samplers and losses are dropped (frees the key's model slots) and
        nothing more is created under it (the SDK documents a finished session as terminal). Finishing a
        session this key does not hold is a no-op, as a client closing after a restart does."""
        sid = request.match_info["session_id"]
        if self.sessions.get(sid) == request["owner"]:
            self._end_session(sid)
        return web.json_response(None)

    def _end_session(self, sid: str) -> None:
        """Release everything of a session: models (and the key's slots), samplers, losses, futures and
        de-duplication records. Its work on the engine is cancelled (`sessions.stop_work`)."""
        with self._lock:
            owner = self.sessions.pop(sid, None)
            self.last_seen.pop(sid, None)
            if owner is None:
                return
            prefix = sid + ":"
            for ident in [m for m in self.slots.get(owner, ()) if m.startswith(prefix)]:
                self._free_slot(owner, ident)
            self.sampler_slots.end_session(sid)
            closing, samplers = [], 0
            for table in (self.models, self.samplers, self.losses):
                for ident in [i for i in table if i.startswith(prefix)]:
                    obj = table.pop(ident)
                    self.owner.pop(ident, None)
                    samplers += table is self.samplers
                    if table is not self.losses:
                        closing.append(obj)
            for rid in [r for r, p in self.futures.items() if p.session == sid]:
                self._forget_future(rid)
            for k in [k for k in self.taken if str(k[2]).startswith(prefix) or k[2] == sid]:
                del self.taken[k]
        for obj in closing:
            stop_work(obj)
        if samplers:
            self._release_memory()
        # ended sessions stay listed (REST `sessions`) up to the per-key cap, newest first
        ended = sorted((s.created_at, i) for i, s in self.rest.sessions.items()
                       if s.owner == owner and i not in self.sessions)
        for _, i in ended[:max(0, len(ended) - self.limits.sessions_per_key)]:
            del self.rest.sessions[i]

    def _release_memory(self) -> None:
        """What dropped samplers held goes back to the OS, off the event loop (`release_memory`)."""
        if hasattr(self.engine, "release_memory"):
            self._pool.submit(self.engine.release_memory)

    def _new_sampler(self, sid: str) -> None:
        """Reserve a place for sampler `sid` (`SamplerSlots.reserve`); drop the one it retires (idle, so
        nothing of it is cancelled: an inflight sampler shares its client with the model's others)."""
        with self._lock:
            retire = self.sampler_slots.reserve(sid)
            if retire is not None:
                self.samplers.pop(retire, None)
                self.owner.pop(retire, None)
        if retire is not None:
            self._release_memory()

    def _sampler(self, sid: str | None, request: web.Request, what: str) -> Any:
        """A sampler of this key (404 for another key's, an unknown or a retired one), marked as used."""
        try:
            sc = self._owned(self.samplers, sid, request, what)
        except Refused:
            retired = self.sampler_slots.was_retired(str(sid))
            if retired is not None and self.sessions.get(_session_of(str(sid))) == request["owner"]:
                raise Refused(404, retired) from None
            raise
        self.sampler_slots.used(str(sid))
        return sc

    async def _expire_sessions(self) -> None:
        """End each session not heard from (heartbeat or use) for `session_timeout_s`."""
        every = min(5.0, self.session_timeout_s / 10)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for sid in [s for s, t in list(self.last_seen.items()) if now - t > self.session_timeout_s]:
                log.info("session %s expired (no heartbeat for %.0f s)", sid, self.session_timeout_s)
                self.expired_sessions += 1
                self._end_session(sid)
            if getattr(self.engine, "memory_to_release", lambda: False)():  # a batch stopped after its end
                self._release_memory()

    async def _start_expiry(self, app: web.Application) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self._expire_sessions())

    async def _stop_expiry(self, app: web.Application) -> None:
        self._expiry.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._expiry

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.get_server_capabilities().model_dump(mode="json"))

    # ------------------------------------------------------------------ models
    async def create_model(self, request: web.Request) -> web.Response:
        req, digest = await self._body(request, types.CreateModelRequest)
        model_id = f"{self._session(req.session_id, request)}:train:{req.model_seq_id}"
        lc = req.lora_config or types.LoraConfig(rank=32)
        check_lora(lc.rank, self.limits)
        check_metadata(req.user_metadata, self.limits)
        check_optimizer_config(req.optimizer_config)
        self._new_model_slot(request, model_id)

        owner = request["owner"]

        def create() -> types.CreateModelResponse:
            try:
                tc = self.engine.create_lora_training_client(
                    req.base_model, rank=lc.rank, seed=lc.seed, train_mlp=lc.train_mlp,
                    train_attn=lc.train_attn, train_unembed=lc.train_unembed, optimizer=req.optimizer_config,
                    run_id=model_id, user_metadata=req.user_metadata)
            except BaseException:
                self._free_slot(owner, model_id)
                raise
            self._adopt(owner, model_id, tc)
            self.rest.on_run(model_id, request["owner"], req.session_id, req.base_model, lc, req.user_metadata)
            return types.CreateModelResponse(model_id=model_id)

        def make() -> dict:
            self.owner[model_id] = request["owner"]
            return self._register(request, self._in_thread(create), json_result, model_id=model_id)

        return self._once(request, ("create", model_id), digest, make)

    async def load_weights(self, request: web.Request) -> web.Response:
        req, digest = await self._body(request, types.LoadWeightsRequest)
        self.rest.check_load(req.path, request["owner"])  # 4xx now for a path this key may not load
        if req.model_id is None:  # 0.38: a new training client created from a checkpoint
            if req.session_id is None or req.model_seq_id is None:
                raise Refused(400, "load_weights needs model_id, or session_id and model_seq_id")
            check_optimizer_config(req.optimizer_config)
            model_id = f"{self._session(req.session_id, request)}:train:{req.model_seq_id}"
            check_metadata(req.user_metadata, self.limits)
            self._new_model_slot(request, model_id)
            owner = request["owner"]
            make = (self.engine.create_training_client_from_state_with_optimizer if req.optimizer
                    else self.engine.create_training_client_from_state)

            def load() -> types.LoadWeightsResponse:
                try:
                    tc = make(req.path, run_id=model_id, user_metadata=req.user_metadata)
                except BaseException:
                    self._free_slot(owner, model_id)
                    raise
                self._adopt(owner, model_id, tc)
                self.rest.on_run(model_id, request["owner"], req.session_id, tc.base_model, types.LoraConfig(
                    rank=tc.rank, train_mlp=tc.trains("mlp"), train_attn=tc.trains("attn"),
                    train_unembed=tc.trains("unembed")), req.user_metadata, source_path=req.path)
                return types.LoadWeightsResponse(path=req.path, model_id=model_id)

            def make_new() -> dict:
                self.owner[model_id] = request["owner"]
                return self._register(request, self._in_thread(load), json_result, model_id=model_id)

            return self._once(request, ("create", model_id), digest, make_new)
        model_id = req.model_id
        self._model(model_id, request)

        def submit(tc: Any) -> Any:
            return tc.load_state_with_optimizer(req.path) if req.optimizer else tc.load_state(req.path)

        return self._once(request, ("train", model_id, req.seq_id), digest, lambda: self._register(
            request, self._train(model_id, request, submit), json_result, model_id=model_id))

    async def get_info(self, request: web.Request) -> web.Response:
        req, _ = await self._body(request, types.GetInfoRequest)
        info = self._model(req.model_id, request).get_info()
        return web.json_response(info.model_copy(update={"model_id": req.model_id}).model_dump(mode="json",
                                                                                               exclude_none=True))

    # ------------------------------------------------------------------ training
    async def forward_backward(self, request: web.Request) -> web.Response:
        body = await self._read(request)
        try:
            model_id = peek_model_id(body)
        except ValueError as e:
            raise Refused(400, f"bad ForwardBackwardRequest: {e}") from None
        self._model(model_id, request)  # before the (possibly large) body is decoded

        def decode() -> tuple:
            try:
                out = decode_forward_backward(body)
            except Exception as e:  # noqa: BLE001 - a malformed body is the client's fault
                raise Refused(400, f"bad ForwardBackwardRequest: {str(e)[:300]}") from None
            if out[0] != model_id:  # a second model_id field would win in the full decode
                raise Refused(400, "bad ForwardBackwardRequest: model_id appears more than once")
            check_batch(out[2], out[4], self.limits)
            if out[3] == "custom":
                self._check_loss_cost(out[4], out[2], request["owner"])
            elif out[3] != "stable_reinforce":
                check_loss_fn(out[3], out[4])
            return out

        _, seq_id, data, loss_fn, config, forward_only = await asyncio.get_running_loop().run_in_executor(
            self._pool, decode)
        if loss_fn == "stable_reinforce":
            raise Refused(400, STABLE_REINFORCE_REFUSAL)

        def submit(tc: Any) -> Any:
            if loss_fn == "custom":
                loss_id = str(config.get("loss_id"))
                handle = self.losses.get(loss_id)
                if handle is None or self.owner.get(loss_id) != request["owner"]:
                    raise ValueError(f"unknown custom loss id {loss_id[:100]!r}")
                return tc.forward_backward_custom(data, handle)
            cfg = config or None
            return tc.forward(data, loss_fn, cfg) if forward_only else tc.forward_backward(data, loss_fn, cfg)

        return self._once(request, ("train", model_id, seq_id), _digest(body), lambda: self._register(
            request, self._train(model_id, request, submit), _fb, model_id=model_id))

    def _check_loss_cost(self, config: dict[str, Any], data: list[types.Datum], owner: str) -> None:
        """A registered loss's cost on this request's shapes, before it is queued (`graph_cost`)."""
        loss_id = str(config.get("loss_id"))
        handle = self.losses.get(loss_id)
        if handle is None or self.owner.get(loss_id) != owner:
            return  # the engine refuses it by name, as before
        check_loss_inputs(handle, data)
        shapes = [[_shape(d.loss_fn_inputs["target_tokens"], torch.float32),
                   *(_shape(d.loss_fn_inputs[n]) for n in handle.input_names)] for d in data]
        try:
            check_request(handle.graph, shapes, self.limits)
        except CostExceeded:
            raise
        except Exception as e:  # noqa: BLE001 - the graph fails on these shapes: it would fail when run too
            raise ValueError(f"custom loss {handle.name[:80]!r} fails on this request's input shapes: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None

    async def optim_step(self, request: web.Request) -> web.Response:
        req, digest = await self._body(request, types.OptimStepRequest)
        self._model(req.model_id, request)
        check_adam(req.optim_params)
        return self._once(request, ("train", req.model_id, req.seq_id), digest, lambda: self._register(
            request, self._train(req.model_id, request, lambda tc: tc.optim_step(req.optim_params)), json_result,
            model_id=req.model_id))

    async def save_weights(self, request: web.Request) -> web.Response:
        req, digest = await self._body(request, types.SaveWeightsRequest)
        self._model(req.model_id, request)
        name = check_checkpoint_name(req.path or f"seq{req.seq_id}")
        return self._once(request, ("train", req.model_id, req.seq_id), digest, lambda: self._register(
            request, self._train(req.model_id, request, lambda tc: tc.save_state(
                name, ttl_seconds=req.ttl_seconds, overwrite=req.overwrite, user_metadata=req.user_metadata)),
            json_result, model_id=req.model_id))

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        """A named sampler checkpoint, or (no `path`) a sampling session on a snapshot of the weights.

        The SDK takes a new `sampling_session_seq_id` each time it sends the unnamed form, resends included
        (tinker 0.38 `training_client.py::_save_weights_for_sampler_impl`, inside `execute_with_retries`),
        so that field is left out of the resend digest: a resend is the same request and gets the first
        reply (whose sampler id the SDK then uses). `kind="inflight"`: every inflight sampler of the model
        follows the model's latest inflight save (`_Inflight`), as the SDK's `SamplingClientKind` describes.
        """
        req, _ = await self._body(request, types.SaveWeightsForSamplerRequest)
        digest = _digest(req.model_dump_json(exclude={"sampling_session_seq_id"}))
        model_id = req.model_id
        self._model(model_id, request)
        if req.path is not None:
            name = check_checkpoint_name(req.path)
            return self._once(request, ("train", model_id, req.seq_id), digest, lambda: self._register(
                request, self._train(model_id, request, lambda tc: tc.save_weights_for_sampler(
                    name, ttl_seconds=req.ttl_seconds, user_metadata=req.user_metadata)), json_result,
                model_id=model_id))
        sid = f"{_session_of(model_id)}:sample:{req.sampling_session_seq_id}"

        def make() -> dict:
            self._new_sampler(sid)
            holder: dict[str, Any] = {}

            def submit(tc: Any) -> Any:
                sc = tc.save_weights_and_get_sampling_client()  # the snapshot runs in the client's order
                sc.tenant = request["owner"]  # the engine's sampler takes keys in turn
                holder["sc"] = sc
                return sc._snap_future

            fut = self._train(model_id, request, submit)

            def publish(_: Any) -> types.SaveWeightsForSamplerResponseInternal:
                with self._lock:  # not into a session that ended while the snapshot was taken
                    if self.sessions.get(_session_of(model_id)) != request["owner"]:
                        raise ValueError(f"session {_session_of(model_id)} ended before its sampler was "
                                         "ready")
                    self.owner[sid] = request["owner"]
                    sc = holder["sc"]
                    if req.kind == "inflight":  # each inflight sampler of the model follows the new weights
                        for other in list(self.samplers.values()):
                            if isinstance(other, _Inflight) and other.model_id == model_id:
                                other.current = sc
                        sc = _Inflight(model_id, sc)
                    self.samplers[sid] = sc
                self.rest.on_sampler(sid, _session_of(model_id))
                return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid)

            out = then(fut, publish)

            def unreserve(f: Future) -> None:  # a snapshot that failed holds no place
                if f.exception() is not None:
                    self.sampler_slots.free(sid)

            out.add_done_callback(unreserve)
            return self._register(request, out, json_result, model_id=model_id)

        return self._once(request, ("train", model_id, req.seq_id), digest, make)

    async def create_custom_loss(self, request: web.Request) -> web.Response:
        req, digest = await self._body(request, types.CreateCustomLossRequest)
        loss_id = f"{self._session(req.session_id, request)}:loss:{req.custom_loss_seq_id}"

        def build() -> Any:
            graph = rebuild_graph(req.graph)
            check_at_upload(graph, [i.rank for i in req.inputs], self.limits)  # logprobs first
            return graph

        try:  # off the event loop: the cost check runs the graph on fake tensors
            graph = await asyncio.get_running_loop().run_in_executor(self._pool, build)
        except ValueError as e:  # refused before it is stored: nothing of it ever runs
            raise Refused(400, str(e)) from None

        def make() -> dict:
            self.losses[loss_id] = LossHandle(name=req.name, inputs=tuple(req.inputs),
                                              session_id=self.engine.session_id, graph=graph, loss_id=loss_id)
            self.owner[loss_id] = request["owner"]
            reply = types.CreateCustomLossResponse(loss_id=loss_id)
            return self._register(request, _done(reply), json_result, session=loss_id)

        return self._once(request, ("loss", loss_id), digest, make)

    # ------------------------------------------------------------------ sampling
    async def create_sampling_session(self, request: web.Request) -> web.Response:
        req, _ = await self._body(request, types.CreateSamplingSessionRequest)
        sid = f"{self._session(req.session_id, request)}:sample:{req.sampling_session_seq_id}"
        if req.model_path is not None:
            self.rest.check_load(req.model_path, request["owner"])
        if sid not in self.samplers:
            self._new_sampler(sid)
            try:
                sc = await asyncio.get_running_loop().run_in_executor(self._pool, lambda: self.engine.create_sampling_client(
                    model_path=req.model_path, base_model=req.base_model))
            except (ValueError, KeyError, FileNotFoundError) as e:
                self.sampler_slots.free(sid)
                raise Refused(400, str(e)[:300]) from None
            except BaseException:
                self.sampler_slots.free(sid)
                raise
            sc.tenant = request["owner"]  # the engine's sampler takes keys in turn
            with self._lock:
                self._session(req.session_id, request)  # it may have ended while the sampler was made
                self.samplers[sid] = sc
                self.owner[sid] = request["owner"]
            self.rest.on_sampler(sid, req.session_id)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sid = request.match_info["sampler_id"]
        sc = self._sampler(sid, request, "sampler")
        return web.json_response(types.GetSamplerResponse(sampler_id=sid, base_model=sc.get_base_model(),
                                                          model_path=sc.model_path).model_dump(mode="json"))

    async def asample(self, request: web.Request) -> web.Response:
        req, digest = await self._body(request, types.SampleRequest)
        sc = self._sampler(req.sampling_session_id, request, "sampling session")
        check_text_only(req.prompt, "prompt")
        check_sample(req, self.limits)
        asked = [f for f, on in (("topk_sample_logprobs", req.topk_sample_logprobs),
                                 ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                 ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)) if on]
        if asked:  # answering without them would read as "none": the SDK would take that as the result
            raise Refused(400, f"{', '.join(asked)}: not implemented by this server's engine, which returns "
                               "sampled-token logprobs, prompt logprobs and top-k prompt logprobs (all "
                               "positions, or the last n) only")

        def make() -> dict:
            fut = sc.sample(req.prompt, req.num_samples, req.sampling_params,
                            include_prompt_logprobs=bool(req.prompt_logprobs),
                            topk_prompt_logprobs=req.topk_prompt_logprobs,
                            topk_sample_logprobs=req.topk_sample_logprobs,
                            prompt_logprobs_last_n=req.prompt_logprobs_last_n).future()
            # one id per sample, fixed at submission (the SDK stamps them onto the sequences)
            ids = [f"{req.sampling_session_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]
            self.sampler_slots.started(req.sampling_session_id)  # a busy sampler is never retired
            fut.add_done_callback(lambda _: self.sampler_slots.finished(req.sampling_session_id))
            return self._register(request, fut, _sample, sample_sequence_ids=ids,
                                  session=req.sampling_session_id)

        return self._once(request, ("sample", req.sampling_session_id, req.seq_id), digest, make)

    # ------------------------------------------------------------------ futures
    async def retrieve_future(self, request: web.Request) -> web.Response:
        req, _ = await self._body(request, types.FutureRetrieveRequest)
        if req.request_id in self.expired:  # the SDK resubmits on 410 where it can
            return web.json_response({"detail": f"promise {req.request_id} expired"}, status=410)
        pending = self._owned(self.futures, req.request_id, request, "request_id")
        self._touch(pending.session)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), timeout=self.poll_s)
        except TimeoutError:
            return web.json_response({"type": "try_again"})
        except Exception:  # noqa: BLE001, S110 - reported below from the future itself
            pass
        fault = request.get("fault")
        if fault in ("failed_server", "failed_user"):
            return web.json_response({"error": f"injected fault {fault}", "category": fault.split("_")[1]})
        exc = pending.future.exception()
        if exc is not None:
            category = "user" if isinstance(exc, ValueError) else "server"
            return web.json_response({"error": f"{type(exc).__name__}: {exc}", "category": category})
        try:
            body, ctype = pending.encode(pending.future.result())
        except Exception as e:
            log.exception("encoding the result of %s failed", req.request_id)
            return web.json_response({"error": f"server could not encode the result: {e}", "category": "server"})
        return web.Response(body=body, content_type=ctype.split(";")[0])
