"""Handlers of the training resource (tinker 0.38 `resources/training.py` and the saves of
`resources/weights.py`) and the one path every training command takes to the engine.

Ordering: the SDK sends a training client's requests one at a time in `seq_id` order (client config
`parallel_fwdbwd_chunks=false`; `training_client.py::_take_turn` waits for the previous POST), so handing
each one to the engine's per-model ordered worker inside its POST handler (`command`) keeps that order. A
resend of a request the server already took (a reply lost to a dropped connection or a timeout) is answered
with the first one's future, by `(model_id, seq_id)`, so it is never applied twice (`futures.FutureTable`).
A `forward_backward` protobuf is decoded off the event loop, after the model id it names (read from the
first bytes) is checked; a registered custom loss is costed on the request's shapes before it is queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from aiohttp import web
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs

from trainer.serve.bodies import digest as body_digest
from trainer.serve.futures import done, failed
from trainer.serve.graph_cost import CostExceeded, check_at_upload, check_request
from trainer.serve.limits import check_adam, check_batch, check_checkpoint_name, check_loss_fn
from trainer.serve.replies import Refused, json_result
from trainer.serve.wire import (
    decode_forward_backward,
    encode_forward_backward_output,
    peek_model_id,
    rebuild_graph,
)

PROTO = "application/x-protobuf"

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


class ModelLost(RuntimeError):
    """The model was dropped by an injected `poison` fault; its requests fail from then on."""


def _fb(out: types.ForwardBackwardOutput) -> tuple[bytes, str]:
    return encode_forward_backward_output(out), PROTO


def _shape(td: types.TensorData, dtype: torch.dtype | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    shape = tuple(td.shape) if td.shape is not None else (len(td.data),)
    return shape, dtype or (torch.int64 if td.dtype == "int64" else torch.float32)


class TrainingRoutes:
    def __init__(self, server: Any):
        self.s = server  # the TinkerServer: engine, limits, bodies, registry, futures, pool, sampling

    def train(self, model_id: str, request: web.Request, submit: Callable[[Any], Any]) -> Future:
        """Hand a training request to the model's ordered worker (or fail it if the model was lost)."""
        reg = self.s.registry
        tc = reg.model(model_id, request["owner"])
        if request.get("fault") == "poison":
            reg.poisoned.add(model_id)
        if model_id in reg.poisoned:
            return failed(ModelLost(f"model {model_id} was lost on the server (injected poison fault); "
                                    "create a new training client from a checkpoint"))
        try:
            out = submit(tc)
            return out if isinstance(out, Future) else out.future()
        except ValueError as e:
            return failed(e)

    def command(self, request: web.Request, model_id: str, seq_id: int, digest: str,
                submit: Callable[[Any], Any], encode: Callable[[Any], tuple[bytes, str]] = json_result
                ) -> web.Response:
        """One command of a model's log: taken once per `(model_id, seq_id)`, run in the model's order."""
        owner = request["owner"]
        futures = self.s.futures
        return futures.once(owner, ("train", model_id, seq_id), digest, lambda: futures.register(
            owner, self.train(model_id, request, submit), encode, model_id=model_id))

    async def forward_backward(self, request: web.Request) -> web.Response:
        s, owner = self.s, request["owner"]
        body = await s.bodies.read(request)
        try:
            model_id = peek_model_id(body)
        except ValueError as e:
            raise Refused(400, f"bad ForwardBackwardRequest: {e}") from None
        s.registry.model(model_id, owner)  # before the (possibly large) body is decoded

        def decode() -> tuple:
            try:
                out = decode_forward_backward(body)
            except Exception as e:  # noqa: BLE001 - a malformed body is the client's fault
                raise Refused(400, f"bad ForwardBackwardRequest: {str(e)[:300]}") from None
            if out[0] != model_id:  # a second model_id field would win in the full decode
                raise Refused(400, "bad ForwardBackwardRequest: model_id appears more than once")
            check_batch(out[2], out[4], s.limits)
            if out[3] == "custom":
                self._check_loss_cost(out[4], out[2], owner)
            elif out[3] != "stable_reinforce":
                check_loss_fn(out[3], out[4])
            return out

        _, seq_id, data, loss_fn, config, forward_only = await asyncio.get_running_loop().run_in_executor(
            s.pool, decode)
        if loss_fn == "stable_reinforce":
            raise Refused(400, STABLE_REINFORCE_REFUSAL)

        def submit(tc: Any) -> Any:
            if loss_fn == "custom":
                loss_id = str(config.get("loss_id"))
                handle = s.registry.losses.get(loss_id)
                if handle is None or s.registry.owner.get(loss_id) != owner:
                    raise ValueError(f"unknown custom loss id {loss_id[:100]!r}")
                return tc.forward_backward_custom(data, handle)
            cfg = config or None
            return tc.forward(data, loss_fn, cfg) if forward_only else tc.forward_backward(data, loss_fn, cfg)

        return self.command(request, model_id, seq_id, body_digest(body), submit, _fb)

    def _check_loss_cost(self, config: dict[str, Any], data: list[types.Datum], owner: str) -> None:
        """A registered loss's cost on this request's shapes, before it is queued (`graph_cost`)."""
        loss_id = str(config.get("loss_id"))
        handle = self.s.registry.losses.get(loss_id)
        if handle is None or self.s.registry.owner.get(loss_id) != owner:
            return  # the engine refuses it by name, as before
        check_loss_inputs(handle, data)
        shapes = [[_shape(d.loss_fn_inputs["target_tokens"], torch.float32),
                   *(_shape(d.loss_fn_inputs[n]) for n in handle.input_names)] for d in data]
        try:
            check_request(handle.graph, shapes, self.s.limits)
        except CostExceeded:
            raise
        except Exception as e:  # noqa: BLE001 - the graph fails on these shapes: it would fail when run too
            raise ValueError(f"custom loss {handle.name[:80]!r} fails on this request's input shapes: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None

    async def optim_step(self, request: web.Request) -> web.Response:
        req, digest = await self.s.bodies.parse(request, types.OptimStepRequest)
        self.s.registry.model(req.model_id, request["owner"])
        check_adam(req.optim_params)
        return self.command(request, req.model_id, req.seq_id, digest,
                            lambda tc: tc.optim_step(req.optim_params))

    async def save_weights(self, request: web.Request) -> web.Response:
        req, digest = await self.s.bodies.parse(request, types.SaveWeightsRequest)
        self.s.registry.model(req.model_id, request["owner"])
        name = check_checkpoint_name(req.path or f"seq{req.seq_id}")
        return self.command(request, req.model_id, req.seq_id, digest, lambda tc: tc.save_state(
            name, ttl_seconds=req.ttl_seconds, overwrite=req.overwrite, user_metadata=req.user_metadata))

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        """A named sampler checkpoint, or (no `path`) a sampling session on a snapshot of the weights
        (`SamplingRoutes.snapshot`).

        The SDK takes a new `sampling_session_seq_id` each time it sends the unnamed form, resends included
        (tinker 0.38 `training_client.py::_save_weights_for_sampler_impl`, inside `execute_with_retries`),
        so that field is left out of the resend digest: a resend is the same request and gets the first
        reply (whose sampler id the SDK then uses)."""
        req, _ = await self.s.bodies.parse(request, types.SaveWeightsForSamplerRequest)
        digest = body_digest(req.model_dump_json(exclude={"sampling_session_seq_id"}))
        self.s.registry.model(req.model_id, request["owner"])
        if req.path is None:
            return self.s.sampling.snapshot(request, req, digest)
        name = check_checkpoint_name(req.path)
        return self.command(request, req.model_id, req.seq_id, digest, lambda tc: tc.save_weights_for_sampler(
            name, ttl_seconds=req.ttl_seconds, user_metadata=req.user_metadata))

    async def create_custom_loss(self, request: web.Request) -> web.Response:
        s, owner = self.s, request["owner"]
        req, digest = await s.bodies.parse(request, types.CreateCustomLossRequest)
        loss_id = f"{s.registry.session(req.session_id, owner)}:loss:{req.custom_loss_seq_id}"

        def build() -> Any:
            graph = rebuild_graph(req.graph)
            check_at_upload(graph, [i.rank for i in req.inputs], s.limits)  # logprobs first
            return graph

        try:  # off the event loop: the cost check runs the graph on fake tensors
            graph = await asyncio.get_running_loop().run_in_executor(s.pool, build)
        except ValueError as e:  # refused before it is stored: nothing of it ever runs
            raise Refused(400, str(e)) from None

        def make() -> dict:
            s.registry.losses[loss_id] = LossHandle(name=req.name, inputs=tuple(req.inputs),
                                                    session_id=s.engine.session_id, graph=graph,
                                                    loss_id=loss_id)
            s.registry.owner[loss_id] = owner
            reply = types.CreateCustomLossResponse(loss_id=loss_id)
            return s.futures.register(owner, done(reply), json_result, session=loss_id)

        return s.futures.once(owner, ("loss", loss_id), digest, make)
