"""Client input never gets a 5xx, resends are idempotent as the SDK sends them, and the cookbook-0.6 surface
(`record_stability_info`, sequence ids, provenance spans, `inflight` samplers, `stable_reinforce`), against
`python -m trainer.serve` on loopback with tinker 0.38's own request types and serializers.

The fuzz test builds each body the way the SDK's resources do (`tinker._compat.model_dump(...,
exclude_none=True, mode="json")`, `forward_backward_request_to_proto`) and posts it raw, because the SDK
itself resends a 5xx for minutes and would hide it.
"""

from __future__ import annotations

import itertools
import sys
import time
import typing
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tinker_wire import Server

TINY = "pairedrl/tiny-random"
KEY = "tml-proto"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("proto_state"))
    yield s
    s.stop()


def _datum(n: int = 6, **extra):
    from tinker import types

    toks = list(range(5, 5 + n))
    inputs = {"target_tokens": toks[1:], "weights": [1.0] * (n - 1), "logprobs": [-1.0] * (n - 1),
              "advantages": [0.5] * (n - 1), **extra}
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)


class Raw:
    """Bodies as the SDK serializes them, posted without its retries; every reply checked for shape."""

    def __init__(self, url: str):
        import httpx

        self.http = httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60)
        self.seen: list[tuple[str, int]] = []

    def post(self, endpoint: str, request) -> tuple[int, dict]:
        from tinker._compat import model_dump

        body = model_dump(request, exclude_unset=False, exclude_none=True, mode="json")
        return self._check(endpoint, self.http.post(f"/api/v1/{endpoint}", json=body))

    def post_fb(self, request, forward_only: bool = False) -> tuple[int, dict]:
        from tinker.proto.request_conv import forward_backward_request_to_proto

        msg = forward_backward_request_to_proto(request)
        msg.forward_only = forward_only
        r = self.http.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                           headers={"Content-Type": "application/x-protobuf"})
        return self._check("forward_backward", r)

    def _check(self, endpoint: str, r) -> tuple[int, dict]:
        self.seen.append((endpoint, r.status_code))
        assert r.status_code < 500, (endpoint, r.status_code, r.text[:500])
        body = r.json()
        if r.status_code >= 400:
            detail = body["detail"]
            assert isinstance(detail, str) and detail and "\n" not in detail, (endpoint, detail)
        return r.status_code, body

    def settle(self, reply: dict) -> dict:
        """The outcome of an accepted request's future: a result, or a failure of category user."""
        rid = reply["request_id"]
        while True:
            r = self.http.post("/api/v1/retrieve_future", json={"request_id": rid})
            assert r.status_code < 500, (rid, r.status_code, r.text[:300])
            if r.headers.get("content-type", "").startswith("application/x-protobuf"):
                return {"ok": True}
            body = r.json()
            if body.get("type") == "try_again":
                continue
            if "error" in body:
                assert body["category"] == "user", body
                assert "\n" not in body["error"], body
            return body


def _session(raw: Raw) -> str:
    from tinker import types

    _, body = raw.post("create_session", types.CreateSessionRequest(tags=[], user_metadata={},
                                                                    sdk_version="0.38.0"))
    return body["session_id"]


def test_every_request_type_with_every_params_type_gets_2xx_or_a_one_line_4xx(server):
    """Each request type of the SDK (sessions, models, training, optimizers, weights, sampling, futures,
    custom losses) with each params type it defines: AdamParams (in and out of range), DimuonParams and an
    unknown optimizer family, every loss_fn of `LossFnType` with and without its config, provenance spans,
    every sampling option and both sampler kinds. A reply is 2xx (and a future settles with a result or a
    category-user failure) or a 4xx whose JSON `detail` is one line; never a 5xx."""
    from tinker import types
    from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase

    raw = Raw(server.url)
    sid = _session(raw)
    seq = itertools.count(1)
    # models: each optimizer config, ranks in and out of range
    for i, (opt, rank) in enumerate([(types.AdamOptimizerConfig(), 4), (types.DimuonOptimizerConfig(), 4),
                                     (OptimizerConfigBase(type="lion"), 4), (types.AdamOptimizerConfig(), 0),
                                     (types.AdamOptimizerConfig(), 10**6)]):
        status, body = raw.post("create_model", types.CreateModelRequest(
            session_id=sid, model_seq_id=100 + i, base_model=TINY, lora_config=types.LoraConfig(rank=rank),
            optimizer_config=opt))
        if status < 300:
            raw.settle(body)
    status, body = raw.post("create_model", types.CreateModelRequest(
        session_id=sid, model_seq_id=0, base_model=TINY, lora_config=types.LoraConfig(rank=4),
        optimizer_config=types.AdamOptimizerConfig()))
    assert status == 200 and raw.settle(body).get("model_id")
    mid = body["model_id"]
    raw.post("get_info", types.GetInfoRequest(model_id=mid))

    # training: every loss_fn, with its config, without it, and with a bad value; forward-only too
    configs = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, "dro": {"beta": 0.1},
               "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "custom": {"loss_id": "nope"}}
    span = [types.SampledProvenanceSpan(sequence_id="s:0:0", length=5)]
    loss_fns = typing.get_args(types.LossFnType)
    for loss_fn in loss_fns:
        for cfg in (configs.get(loss_fn), None, {"beta": float("nan")}, {"x": "text"}):
            for data in ([_datum()], [_datum().with_provenance(span, span)]):
                for forward_only in (False, True):
                    req = types.ForwardBackwardRequest(types.ForwardBackwardInput(data, loss_fn, cfg), mid,
                                                       next(seq))
                    status, body = raw.post_fb(req, forward_only)
                    if status < 300:
                        raw.settle(body)
    # optimizers: AdamParams in range and out of it, DimuonParams, an unknown family
    for params in (types.AdamParams(learning_rate=1e-3), types.AdamParams(learning_rate=-1.0),
                   types.AdamParams(beta2=1.5), types.DimuonParams(learning_rate=1e-4),
                   OptimParamsBase(type="lion")):
        status, body = raw.post("optim_step", types.OptimStepRequest(optim_params=params, model_id=mid,
                                                                     seq_id=next(seq)))
        if status < 300:
            raw.settle(body)
    # weights: named and unnamed, both sampler kinds, TTLs, bad names; loads good and bad
    for req in (types.SaveWeightsRequest(model_id=mid, path="w1", seq_id=next(seq)),
                types.SaveWeightsRequest(model_id=mid, path="../x", seq_id=next(seq)),
                types.SaveWeightsRequest(model_id=mid, path="w2", seq_id=next(seq), ttl_seconds=3600),
                types.SaveWeightsForSamplerRequest(model_id=mid, path="s1", seq_id=next(seq)),
                types.SaveWeightsForSamplerRequest(model_id=mid, seq_id=next(seq),
                                                   sampling_session_seq_id=50),
                types.SaveWeightsForSamplerRequest(model_id=mid, seq_id=next(seq), sampling_session_seq_id=51,
                                                   kind="inflight")):
        endpoint = "save_weights" if isinstance(req, types.SaveWeightsRequest) else "save_weights_for_sampler"
        status, body = raw.post(endpoint, req)
        if status < 300:
            raw.settle(body)
    run = mid
    for path, optimizer in ((f"tinker://{run}/weights/w1", True), (f"tinker://{run}/weights/nope", False),
                            ("tinker://../../etc", False)):
        status, body = raw.post("load_weights", types.LoadWeightsRequest(
            model_id=mid, seq_id=next(seq), path=path, optimizer=optimizer))
        if status < 300:
            raw.settle(body)
    # sampling: each option of SampleRequest, each in and out of range
    status, body = raw.post("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=sid, sampling_session_seq_id=60, base_model=TINY))
    assert status == 200
    ssid = body["sampling_session_id"]
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    target = {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]}
    options = [{}, {"prompt_logprobs": True}, {"topk_prompt_logprobs": 3}, {"topk_prompt_logprobs": 10**6},
               {"topk_sample_logprobs": 2}, {"target_prompt_logprobs": target}, {"prompt_alt_tokens_k": 2},
               {"prompt_logprobs": True, "prompt_logprobs_last_n": 2},
               {"prompt_logprobs": True, "prompt_logprobs_last_n": 99}, {"prompt_logprobs_last_n": 2},
               {"record_stability_info": True}, {"num_samples": 0}, {"num_samples": 10**9}]
    sp = types.SamplingParams
    params = [sp(max_tokens=3), sp(max_tokens=3, seed=7, temperature=0.5),
              sp(max_tokens=3, top_k=2, top_p=0.9), sp(max_tokens=3, stop=["x"]), sp(max_tokens=3, stop=[5]),
              sp(max_tokens=0), sp(max_tokens=3, top_k=0), sp(max_tokens=3, temperature=-1.0),
              sp(max_tokens=10**7)]
    for opt, p in itertools.chain(((o, params[0]) for o in options), (({}, p) for p in params)):
        req = types.SampleRequest(prompt=prompt, sampling_params=p, sampling_session_id=ssid,
                                  seq_id=next(seq), **{"num_samples": 1, **opt})
        status, body = raw.post("asample", req)
        if status < 300:
            raw.settle(body)
    # custom losses: an allowed graph, a refused target, a malformed graph
    graph = types.CustomLossGraph(nodes=[
        types.CustomLossNode(op="placeholder", name="logprobs", target="logprobs"),
        types.CustomLossNode(op="call_function", name="s", target="torch.sum", args=[{"ref": "logprobs"}]),
        types.CustomLossNode(op="output", name="output", target="output", args=[{"ref": "s"}])])
    bad = graph.model_copy(update={"nodes": [graph.nodes[0], graph.nodes[1].model_copy(
        update={"target": "torch.load"}), graph.nodes[2]]})
    for i, g in enumerate((graph, bad)):
        status, body = raw.post("create_custom_loss", types.CreateCustomLossRequest(
            session_id=sid, custom_loss_seq_id=i, name="l",
            inputs=[types.CustomLossInput(name="logprobs", rank=1)], graph=g))
        if status < 300:
            raw.settle(body)
    # futures, heartbeats and the end of the session, with ids that exist and ids that do not
    raw.post("retrieve_future", types.FutureRetrieveRequest(request_id="req-nope"))
    raw.post("session_heartbeat", types.SessionHeartbeatRequest(session_id=sid))
    raw.post("session_heartbeat", types.SessionHeartbeatRequest(session_id="s-nope"))
    r = raw.http.post(f"/api/v1/sessions/{sid}/finish", json={})
    assert r.status_code == 200
    codes = {c for _, c in raw.seen}
    assert codes & {400, 404, 413} and 200 in codes, raw.seen  # the fuzz reached both answers
    assert len(raw.seen) > 150


def test_dimuon_optim_step_is_refused_at_once(server):
    """`optim_step(DimuonParams)` through the SDK: a 400 naming the optimizer the server has, in seconds
    (a 5xx here is resent by the SDK for 300 s)."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(api_key=KEY, base_url=server.url)
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()
    tc.forward_backward([_datum()], "cross_entropy").result()
    t0 = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="AdamW optimizer only"):
        tc.optim_step(types.DimuonParams(learning_rate=1e-4)).result()
    assert time.monotonic() - t0 < 10
    sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server


def test_a_resent_sampler_save_with_a_new_sampling_session_id_is_the_same_request(tmp_path):
    """The SDK's own retry path: the first reply to `save_weights_and_get_sampling_client` is lost after the
    server took the work (`drop`), and the SDK resends it with the same `seq_id` and a new
    `sampling_session_seq_id`. The resend gets the first reply: the client samples, and no second
    snapshot was taken."""
    import tinker
    from tinker import types

    s = Server(tmp_path / "state", "--faults", "at=save_weights_for_sampler#1:drop")
    try:
        sc = tinker.ServiceClient(api_key=KEY, base_url=s.url)
        tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()
        t0 = time.monotonic()
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                             types.SamplingParams(max_tokens=3, seed=1))
        assert len(out.result().sequences) == 2
        assert time.monotonic() - t0 < 120
        stats = s.stats()
        assert stats["faults"] == {"drop": 1}, stats
        assert stats["requests"]["save_weights_for_sampler"] == 2  # the lost reply, then the resend
        sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server
    finally:
        s.stop()


def test_a_sampler_save_resent_with_another_session_seq_id_gets_the_first_reply(server):
    """At the wire: the same `seq_id` with only `sampling_session_seq_id` changed is the same request (the
    first reply, the first sampler); any other change under a taken `seq_id` is still refused with 409."""
    from tinker import types

    raw = Raw(server.url)
    sid = _session(raw)
    _, body = raw.post("create_model", types.CreateModelRequest(
        session_id=sid, model_seq_id=0, base_model=TINY, lora_config=types.LoraConfig(rank=4),
        optimizer_config=types.AdamOptimizerConfig()))
    mid = raw.settle(body)["model_id"]
    first = raw.post("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=mid, seq_id=1, sampling_session_seq_id=0))
    again = raw.post("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=mid, seq_id=1, sampling_session_seq_id=1))
    assert first == again and first[0] == 200
    assert raw.settle(first[1])["sampling_session_id"] == f"{sid}:sample:0"
    other = raw.http.post("/api/v1/save_weights_for_sampler", json=types.SaveWeightsForSamplerRequest(
        model_id=mid, seq_id=1, sampling_session_seq_id=2, kind="inflight").model_dump(mode="json"))
    assert other.status_code == 409


def test_cookbook_06_surface_sequence_ids_provenance_inflight_and_stable_reinforce(server):
    """tinker-cookbook 0.6's RL path through the SDK: a sampler made with `record_stability_info=True` returns
    a distinct `sequence_id` per sequence; a datum carrying provenance spans naming them trains with
    importance_sampling; `stable_reinforce` is refused with a 400 that names the workaround; an `inflight`
    sampler follows the model's later inflight saves (its samples change after an optimizer step), while a
    snapshot sampler keeps its weights."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(api_key=KEY, base_url=server.url)
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=4, seed=3)).result().sequences
    ids = [s.sequence_id for s in seqs]
    assert all(ids) and len(set(ids)) == 3, ids
    toks = prompt.to_ints() + list(seqs[0].tokens)
    n = len(toks) - 1
    d = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
        "target_tokens": toks[1:], "logprobs": [0.0] * 3 + list(seqs[0].logprobs),
        "advantages": [0.0] * 3 + [1.0] * (n - 3)})
    d = d.with_provenance([types.PromptProvenanceSpan(sequence_id=ids[0], length=4),
                           types.SampledProvenanceSpan(sequence_id=ids[0], length=n - 4)],
                          [types.PromptProvenanceSpan(sequence_id=ids[0], offset=1, length=3),
                           types.SampledProvenanceSpan(sequence_id=ids[0], length=n - 3)])
    with pytest.raises(tinker.BadRequestError, match="loss_fn='importance_sampling'"):
        tc.forward_backward([d], "stable_reinforce").result()
    assert "loss:sum" in tc.forward_backward([d], "importance_sampling").result().metrics

    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    before = list(inflight.sample(prompt, 1, greedy).result().sequences[0].tokens)
    assert before == list(snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens)
    for _ in range(3):  # move the weights far enough to change the greedy continuation
        tc.forward_backward([_datum(6, target_tokens=[9, 9, 9, 9, 9])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.5)).result()
    # not yet published
    assert list(inflight.sample(prompt, 1, greedy).result().sequences[0].tokens) == before
    later = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    moved = list(later.sample(prompt, 1, greedy).result().sequences[0].tokens)
    assert moved != before
    assert list(inflight.sample(prompt, 1, greedy).result().sequences[0].tokens) == moved
    assert list(snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens) == before
    sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server


def test_unimplemented_sampling_options_are_refused_not_ignored(server):
    """`target_prompt_logprobs`, `prompt_alt_tokens_k` and `topk_sample_logprobs` get a 400 from the server
    naming the field (an answer without them would read as an empty result)."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(api_key=KEY, base_url=server.url)
    sampler = sc.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    target = types.TensorData(data=[6, 7], dtype="int64", shape=[2, 1])
    for kwargs, field in (({"target_prompt_logprobs": target}, "target_prompt_logprobs"),
                          ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
                          ({"topk_sample_logprobs": 2}, "topk_sample_logprobs")):
        with pytest.raises(tinker.BadRequestError, match=field):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2), **kwargs).result()
    sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server
