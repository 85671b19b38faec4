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

Futures: each accepted request gets an id; `retrieve_future` long-polls it for up to `poll_s` seconds
(under the SDK's 45 s read timeout) and answers `{"type": "try_again"}` while it runs, the result
(JSON, or protobuf for forward/backward and sampling), or `{"error", "category"}` when it failed:
category `user` for a request the engine refused (ValueError), `server` otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle

from trainer.serve.faults import FaultPlan
from trainer.serve.wire import (
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
    rebuild_graph,
)

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


def _json(model: Any) -> tuple[bytes, str]:
    return model.model_dump_json(exclude_none=True).encode(), "application/json"


def _fb(out: types.ForwardBackwardOutput) -> tuple[bytes, str]:
    return encode_forward_backward_output(out), PROTO


def _sample(resp: types.SampleResponse) -> tuple[bytes, str]:
    return encode_sample_response(resp), PROTO


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(exc)
    return f


def _then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of `fn(result)` once `fut` is done (its exception passed on)."""
    out: Future = Future()

    def cb(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            out.set_exception(e)

    fut.add_done_callback(cb)
    return out


def _session_of(model_id: str) -> str:
    return model_id.split(":train:")[0]


class TinkerServer:
    def __init__(self, engine: Any, faults: FaultPlan | None = None, poll_s: float = 20.0,
                 server_side_loss: bool = True, latency_s: float = 0.0):
        self.engine = engine
        self.faults = faults or FaultPlan()
        self.poll_s = poll_s
        self.server_side_loss = server_side_loss
        self.latency_s = latency_s
        self.models: dict[str, Any] = {}
        self.poisoned: set[str] = set()
        self.samplers: dict[str, Any] = {}
        self.losses: dict[str, LossHandle] = {}
        self.futures: dict[str, _Pending] = {}
        self.expired: set[str] = set()
        self.taken: dict[tuple, dict] = {}  # (kind, id, seq) -> the UntypedAPIFuture reply already given
        self.counts: dict[str, int] = {}  # requests per endpoint (benchmarks read them from /stats)
        self._ids = itertools.count(1)
        self._sessions = itertools.count(1)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="serve-load")

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=512 * 2**20)
        r = app.router
        post = {
            "client/config": self.client_config, "client/dynamic_config": self.dynamic_config,
            "create_session": self.create_session, "session_heartbeat": self.ok({"type": "session_heartbeat"}),
            "telemetry": self.ok({"status": "accepted"}), "create_model": self.create_model,
            "get_info": self.get_info, "forward_backward": self.forward_backward, "optim_step": self.optim_step,
            "save_weights": self.save_weights, "save_weights_for_sampler": self.save_weights_for_sampler,
            "load_weights": self.load_weights, "create_sampling_session": self.create_sampling_session,
            "asample": self.asample, "retrieve_future": self.retrieve_future,
            "create_custom_loss": self.create_custom_loss, "sessions/{session_id}/finish": self.ok(None),
        }
        for path, handler in post.items():
            r.add_post(f"/api/v1/{path}", handler)
        r.add_get("/api/v1/healthz", self.ok({"status": "ok"}))
        r.add_get("/api/v1/get_server_capabilities", self.capabilities)
        r.add_get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        r.add_get("/stats", self.stats)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        endpoint = request.path.removeprefix("/api/v1/")
        if request.path.startswith("/api/"):
            key = request.headers.get("X-API-Key", "")
            if not key.startswith("tml-"):
                return web.json_response({"detail": "invalid API key: this server accepts any key starting "
                                                    "with 'tml-'"}, status=401)
        self.counts[endpoint] = self.counts.get(endpoint, 0) + 1
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

    @staticmethod
    def ok(body: Any) -> Callable:
        async def handler(request: web.Request) -> web.Response:
            return web.json_response(body)

        return handler

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.counts, "faults": self.faults.injected})

    # ------------------------------------------------------------------ helpers
    def _register(self, future: Future, encode: Callable[[Any], tuple[bytes, str]], **extra: Any) -> dict:
        rid = f"req-{next(self._ids)}"
        self.futures[rid] = _Pending(future, encode)
        if len(self.futures) > MAX_FUTURES:  # the oldest finished results expire, as promises do on the service
            for old in [k for k, p in itertools.islice(self.futures.items(), len(self.futures) // 4)
                        if p.future.done()]:
                del self.futures[old]
                self.expired.add(old)
        return {"request_id": rid, **{k: v for k, v in extra.items() if v is not None}}

    def _once(self, key: tuple, make: Callable[[], dict]) -> web.Response:
        """The future reply of a request; a resend of the same key gets the first reply again."""
        with self._lock:
            reply = self.taken.get(key)
            if reply is None:
                reply = self.taken[key] = make()
        return web.json_response(reply)

    def _model(self, model_id: str) -> Any:
        tc = self.models.get(model_id)
        if tc is None:
            raise web.HTTPNotFound(text=f'{{"detail": "unknown model_id {model_id}"}}', content_type="application/json")
        return tc

    def _train(self, model_id: str, request: web.Request, submit: Callable[[Any], Any]) -> Future:
        """Hand a training request to the model's ordered worker (or fail it if the model was lost)."""
        tc = self._model(model_id)
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

    @staticmethod
    async def _body(request: web.Request, cls: Any) -> Any:
        try:
            return cls.model_validate(await request.json())
        except Exception as e:  # noqa: BLE001 - a malformed body is the client's fault
            raise web.HTTPBadRequest(text=f'{{"detail": "bad {cls.__name__}: {str(e)[:300]!r}"}}',
                                     content_type="application/json") from None

    # ------------------------------------------------------------------ session
    async def client_config(self, request: web.Request) -> web.Response:
        cfg = types.ClientConfigResponse(pjwt_auth_enabled=False, use_pyqwest_transport=False,
                                         parallel_fwdbwd_chunks=False, proto_compress_fwdbwd=False,
                                         custom_loss_server_side=self.server_side_loss)
        return web.json_response(cfg.model_dump(mode="json"))

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response(types.ClientDynamicConfigResponse().model_dump(mode="json"))

    async def create_session(self, request: web.Request) -> web.Response:
        await self._body(request, types.CreateSessionRequest)
        return web.json_response({"type": "create_session", "session_id": f"s{next(self._sessions)}"})

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.get_server_capabilities().model_dump(mode="json"))

    # ------------------------------------------------------------------ models
    async def create_model(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.CreateModelRequest)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        lc = req.lora_config or types.LoraConfig(rank=32)

        def create() -> types.CreateModelResponse:
            self.models[model_id] = self.engine.create_lora_training_client(
                req.base_model, rank=lc.rank, seed=lc.seed, train_mlp=lc.train_mlp, train_attn=lc.train_attn,
                train_unembed=lc.train_unembed, optimizer=req.optimizer_config)
            return types.CreateModelResponse(model_id=model_id)

        return self._once(("create", model_id), lambda: self._register(self._in_thread(create), _json,
                                                                        model_id=model_id))

    async def load_weights(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.LoadWeightsRequest)
        if req.model_id is None:  # 0.38: a new training client created from a checkpoint
            if req.session_id is None or req.model_seq_id is None:
                raise web.HTTPBadRequest(text='{"detail": "load_weights needs model_id, or session_id and '
                                              'model_seq_id"}', content_type="application/json")
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            make = (self.engine.create_training_client_from_state_with_optimizer if req.optimizer
                    else self.engine.create_training_client_from_state)

            def load() -> types.LoadWeightsResponse:
                self.models[model_id] = make(req.path)
                return types.LoadWeightsResponse(path=req.path, model_id=model_id)

            return self._once(("create", model_id), lambda: self._register(self._in_thread(load), _json,
                                                                            model_id=model_id))
        model_id = req.model_id

        def submit(tc: Any) -> Any:
            return tc.load_state_with_optimizer(req.path) if req.optimizer else tc.load_state(req.path)

        return self._once(("train", model_id, req.seq_id), lambda: self._register(
            self._train(model_id, request, submit), _json, model_id=model_id))

    async def get_info(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.GetInfoRequest)
        info = self._model(req.model_id).get_info()
        return web.json_response(info.model_copy(update={"model_id": req.model_id}).model_dump(mode="json",
                                                                                               exclude_none=True))

    # ------------------------------------------------------------------ training
    async def forward_backward(self, request: web.Request) -> web.Response:
        try:
            model_id, seq_id, data, loss_fn, config, forward_only = decode_forward_backward(await request.read())
        except Exception as e:  # noqa: BLE001
            raise web.HTTPBadRequest(text=f'{{"detail": "bad ForwardBackwardRequest: {str(e)[:300]!r}"}}',
                                     content_type="application/json") from None

        def submit(tc: Any) -> Any:
            if loss_fn == "custom":
                handle = self.losses.get(str(config.get("loss_id")))
                if handle is None:
                    raise ValueError(f"unknown custom loss id {config.get('loss_id')!r}")
                return tc.forward_backward_custom(data, handle)
            cfg = config or None
            return tc.forward(data, loss_fn, cfg) if forward_only else tc.forward_backward(data, loss_fn, cfg)

        return self._once(("train", model_id, seq_id), lambda: self._register(
            self._train(model_id, request, submit), _fb, model_id=model_id))

    async def optim_step(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.OptimStepRequest)
        return self._once(("train", req.model_id, req.seq_id), lambda: self._register(
            self._train(req.model_id, request, lambda tc: tc.optim_step(req.optim_params)), _json,
            model_id=req.model_id))

    async def save_weights(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SaveWeightsRequest)
        name = req.path or f"seq{req.seq_id}"
        return self._once(("train", req.model_id, req.seq_id), lambda: self._register(
            self._train(req.model_id, request, lambda tc: tc.save_state(name, overwrite=req.overwrite)), _json,
            model_id=req.model_id))

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SaveWeightsForSamplerRequest)
        model_id = req.model_id
        if req.path is not None:
            return self._once(("train", model_id, req.seq_id), lambda: self._register(
                self._train(model_id, request, lambda tc: tc.save_weights_for_sampler(req.path)), _json,
                model_id=model_id))
        sid = f"{_session_of(model_id)}:sample:{req.sampling_session_seq_id}"

        def make() -> dict:
            holder: dict[str, Any] = {}

            def submit(tc: Any) -> Any:
                sc = tc.save_weights_and_get_sampling_client()  # the snapshot runs in the client's order
                holder["sc"] = sc
                return sc._snap_future

            fut = self._train(model_id, request, submit)

            def publish(_: Any) -> types.SaveWeightsForSamplerResponseInternal:
                self.samplers[sid] = holder["sc"]
                return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid)

            return self._register(_then(fut, publish), _json, model_id=model_id)

        return self._once(("train", model_id, req.seq_id), make)

    async def create_custom_loss(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.CreateCustomLossRequest)
        loss_id = f"{req.session_id}:loss:{req.custom_loss_seq_id}"

        def make() -> dict:
            try:
                graph = rebuild_graph(req.graph)
                self.losses[loss_id] = LossHandle(name=req.name, inputs=tuple(req.inputs),
                                                  session_id=self.engine.session_id, graph=graph, loss_id=loss_id)
                fut = _done(types.CreateCustomLossResponse(loss_id=loss_id))
            except ValueError as e:
                fut = _failed(e)
            return self._register(fut, _json)

        return self._once(("loss", loss_id), make)

    # ------------------------------------------------------------------ sampling
    async def create_sampling_session(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.CreateSamplingSessionRequest)
        sid = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if sid not in self.samplers:
            try:
                sc = await asyncio.get_running_loop().run_in_executor(self._pool, lambda: self.engine.create_sampling_client(
                    model_path=req.model_path, base_model=req.base_model))
            except (ValueError, KeyError, FileNotFoundError) as e:
                raise web.HTTPBadRequest(text=f'{{"detail": {str(e)[:300]!r}}}'.replace("'", '"'),
                                         content_type="application/json") from None
            self.samplers[sid] = sc
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sid = request.match_info["sampler_id"]
        sc = self.samplers.get(sid)
        if sc is None:
            raise web.HTTPNotFound(text=f'{{"detail": "unknown sampler {sid}"}}', content_type="application/json")
        return web.json_response(types.GetSamplerResponse(sampler_id=sid, base_model=sc.get_base_model(),
                                                          model_path=sc.model_path).model_dump(mode="json"))

    async def asample(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SampleRequest)
        sc = self.samplers.get(req.sampling_session_id or "")
        if sc is None:
            raise web.HTTPNotFound(text=f'{{"detail": "unknown sampling session {req.sampling_session_id}"}}',
                                   content_type="application/json")

        def make() -> dict:
            fut = sc.sample(req.prompt, req.num_samples, req.sampling_params,
                            include_prompt_logprobs=bool(req.prompt_logprobs),
                            topk_prompt_logprobs=req.topk_prompt_logprobs,
                            topk_sample_logprobs=req.topk_sample_logprobs,
                            prompt_logprobs_last_n=req.prompt_logprobs_last_n).future()
            # one id per sample, fixed at submission (the SDK stamps them onto the sequences)
            ids = [f"{req.sampling_session_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]
            return self._register(fut, _sample, sample_sequence_ids=ids)

        return self._once(("sample", req.sampling_session_id, req.seq_id), make)

    # ------------------------------------------------------------------ futures
    async def retrieve_future(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.FutureRetrieveRequest)
        pending = self.futures.get(req.request_id)
        if pending is None and req.request_id in self.expired:  # the SDK resubmits on 410 where it can
            return web.json_response({"detail": f"promise {req.request_id} expired"}, status=410)
        if pending is None:
            raise web.HTTPNotFound(text=f'{{"detail": "unknown request_id {req.request_id}"}}',
                                   content_type="application/json")
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
