"""Handlers of the sampling resource (tinker 0.38 `resources/sampling.py`, and the snapshot form of
`save_weights_for_sampler`): sampling sessions on a checkpoint, the base model or a snapshot of a training
client's weights, and sampling requests on them.

Sampling is stateless: a sampler holds fixed weights (a checkpoint, or the snapshot taken in its model's
command order), a request is answered from those weights, its prompt and its sampling parameters alone,
and answering it changes nothing any other request reads. The one exception the SDK defines is
`kind="inflight"` (`SamplingClientKind`): such a sampler follows its model's latest inflight save
(`_Inflight`). Sampler places are counted per session and server-wide (`samplers.SamplerSlots`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

from aiohttp import web
from tinker import types

from trainer.serve.limits import check_sample, check_text_only
from trainer.serve.replies import Refused, json_result
from trainer.serve.samplers import session_of
from trainer.serve.wire import encode_sample_response
from trainer.utils.futures import then

PROTO = "application/x-protobuf"


class _Inflight:
    """An `inflight` sampling session: it samples with the latest weights its model published inflight.

    A sample already queued keeps the snapshot it was given (the SDK's contract lets a generation span
    updates and promises only "the weights saved when the client was created, or newer")."""

    def __init__(self, model_id: str, current: Any):
        self.model_id = model_id
        self.current = current

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)


def _sample(resp: types.SampleResponse) -> tuple[bytes, str]:
    return encode_sample_response(resp), PROTO


class SamplingRoutes:
    def __init__(self, server: Any):
        self.s = server  # the TinkerServer: engine, limits, bodies, registry, futures, training, rest

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        s, owner = self.s, request["owner"]
        reg = s.registry
        req, _ = await s.bodies.parse(request, types.CreateSamplingSessionRequest)
        sid = f"{reg.session(req.session_id, owner)}:sample:{req.sampling_session_seq_id}"
        if req.model_path is not None:
            s.rest.check_load(req.model_path, owner)
        if sid not in reg.samplers:
            reg.new_sampler(sid)
            try:
                sc = await asyncio.get_running_loop().run_in_executor(
                    s.pool, lambda: s.engine.create_sampling_client(model_path=req.model_path,
                                                                    base_model=req.base_model))
            except (ValueError, KeyError, FileNotFoundError) as e:
                reg.sampler_slots.free(sid)
                raise Refused(400, str(e)[:300]) from None
            except BaseException:
                reg.sampler_slots.free(sid)
                raise
            sc.tenant = owner  # the engine's sampler takes keys in turn
            with reg.lock:
                reg.session(req.session_id, owner)  # it may have ended while the sampler was made
                reg.samplers[sid] = sc
                reg.owner[sid] = owner
            s.rest.on_sampler(sid, req.session_id)
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    async def get_sampler(self, request: web.Request) -> web.Response:
        sid = request.match_info["sampler_id"]
        sc = self.s.registry.sampler(sid, request["owner"], "sampler")
        return web.json_response(types.GetSamplerResponse(sampler_id=sid, base_model=sc.get_base_model(),
                                                          model_path=sc.model_path).model_dump(mode="json"))

    async def asample(self, request: web.Request) -> web.Response:
        s, owner = self.s, request["owner"]
        req, digest = await s.bodies.parse(request, types.SampleRequest)
        sc = s.registry.sampler(req.sampling_session_id, owner, "sampling session")
        check_text_only(req.prompt, "prompt")
        check_sample(req, s.limits)
        asked = [f for f, on in (("topk_sample_logprobs", req.topk_sample_logprobs),
                                 ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                 ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)) if on]
        if asked:  # answering without them would read as "none": the SDK would take that as the result
            raise Refused(400, f"{', '.join(asked)}: not implemented by this server's engine, which returns "
                               "sampled-token logprobs, prompt logprobs and top-k prompt logprobs (all "
                               "positions, or the last n) only")
        slots = s.registry.sampler_slots

        def make() -> dict:
            fut = sc.sample(req.prompt, req.num_samples, req.sampling_params,
                            include_prompt_logprobs=bool(req.prompt_logprobs),
                            topk_prompt_logprobs=req.topk_prompt_logprobs,
                            topk_sample_logprobs=req.topk_sample_logprobs,
                            prompt_logprobs_last_n=req.prompt_logprobs_last_n).future()
            # one id per sample, fixed at submission (the SDK stamps them onto the sequences)
            ids = [f"{req.sampling_session_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]
            slots.started(req.sampling_session_id)  # a busy sampler is never retired
            fut.add_done_callback(lambda _: slots.finished(req.sampling_session_id))
            return s.futures.register(owner, fut, _sample, sample_sequence_ids=ids,
                                      session=req.sampling_session_id)

        return s.futures.once(owner, ("sample", req.sampling_session_id, req.seq_id), digest, make)

    def snapshot(self, request: web.Request, req: types.SaveWeightsForSamplerRequest, digest: str
                 ) -> web.Response:
        """A sampling session on a snapshot of the model's weights, taken in the model's command order.
        `kind="inflight"`: every inflight sampler of the model follows the model's latest inflight save
        (`_Inflight`), as the SDK's `SamplingClientKind` describes."""
        s, owner, model_id = self.s, request["owner"], req.model_id
        reg = s.registry
        sid = f"{session_of(model_id)}:sample:{req.sampling_session_seq_id}"

        def make() -> dict:
            reg.new_sampler(sid)
            holder: dict[str, Any] = {}

            def submit(tc: Any) -> Any:
                sc = tc.save_weights_and_get_sampling_client()  # the snapshot runs in the client's order
                sc.tenant = owner  # the engine's sampler takes keys in turn
                holder["sc"] = sc
                return sc._snap_future

            fut = s.training.train(model_id, request, submit)

            def publish(_: Any) -> types.SaveWeightsForSamplerResponseInternal:
                with reg.lock:  # not into a session that ended while the snapshot was taken
                    if reg.sessions.get(session_of(model_id)) != owner:
                        raise ValueError(f"session {session_of(model_id)} ended before its sampler was "
                                         "ready")
                    reg.owner[sid] = owner
                    sc = holder["sc"]
                    if req.kind == "inflight":  # each inflight sampler of the model follows the new weights
                        for other in list(reg.samplers.values()):
                            if isinstance(other, _Inflight) and other.model_id == model_id:
                                other.current = sc
                        sc = _Inflight(model_id, sc)
                    reg.samplers[sid] = sc
                s.rest.on_sampler(sid, session_of(model_id))
                return types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid)

            out = then(fut, publish)

            def unreserve(f: Future) -> None:  # a snapshot that failed holds no place
                if f.exception() is not None:
                    reg.sampler_slots.free(sid)

            out.add_done_callback(unreserve)
            return s.futures.register(owner, out, json_result, model_id=model_id)

        return s.futures.once(owner, ("train", model_id, req.seq_id), digest, make)
