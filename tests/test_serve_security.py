"""`python -m trainer.serve` against a client it cannot trust: what a graph may call, who may touch what,
how much one request may ask, which numbers are refused, and that ids do not survive a restart.

Every test talks to a real server subprocess on 127.0.0.1 with raw HTTP (what an attacker sends) and,
where a well-behaved client is part of the claim, with the unmodified tinker SDK. The non-loopback
policy is tested by what the server does at start-up, never by connecting to another address.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_tinker_wire import ROOT, Server
from tinker import types
from tinker.proto.request_conv import ForwardBackwardRequest, forward_backward_request_to_proto

from trainer.serve import wire
from trainer.serve.graph_ops import FUNCTIONS

BASE = "pairedrl/tiny-random"


class Raw:
    """One client's raw HTTP view of the server: a key, its session, and polling of futures."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url, key
        self.http = httpx.Client(base_url=url + "/api/v1", headers={"X-API-Key": key}, timeout=60)
        self.session = self.ok("create_session", types.CreateSessionRequest(sdk_version="test", tags=[], user_metadata=None))["session_id"]

    def post(self, endpoint: str, body: object = None, **kw) -> httpx.Response:
        if hasattr(body, "model_dump"):
            body = body.model_dump(mode="json")
        return self.http.post("/" + endpoint, json=body, **kw) if body is not None else self.http.post("/" + endpoint, **kw)

    def ok(self, endpoint: str, body: object = None) -> dict:
        r = self.post(endpoint, body)
        assert r.status_code == 200, (endpoint, r.status_code, r.text)
        return r.json()

    def result(self, request_id: str) -> httpx.Response:
        while True:
            r = self.post("retrieve_future", types.FutureRetrieveRequest(request_id=request_id))
            if r.status_code != 200 or r.headers["content-type"].startswith("application/x-protobuf") \
                    or r.json().get("type") != "try_again":
                return r

    def model(self, seq: int = 0, rank: int = 4) -> str:
        reply = self.ok("create_model", types.CreateModelRequest(session_id=self.session, model_seq_id=seq,
                                                                 base_model=BASE, lora_config=types.LoraConfig(rank=rank)))
        assert self.result(reply["request_id"]).status_code == 200
        return reply["model_id"]

    def fwdbwd(self, model_id: str, seq_id: int, advantages: list[float] | None = None, forward_only: bool = False,
               loss_fn: str = "importance_sampling", config: dict | None = None) -> httpx.Response:
        body = fwdbwd_body(model_id, seq_id, advantages, forward_only, loss_fn, config)
        return self.http.post("/forward_backward", content=body, headers={"content-type": "application/x-protobuf"})


def fwdbwd_body(model_id: str, seq_id: int, advantages: list[float] | None = None, forward_only: bool = False,
                loss_fn: str = "importance_sampling", config: dict | None = None, tokens: int = 3) -> bytes:
    adv = advantages if advantages is not None else [1.0] * tokens
    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 5 + tokens))), loss_fn_inputs={
        "target_tokens": types.TensorData(data=list(range(6, 6 + tokens)), dtype="int64", shape=[tokens]),
        "logprobs": types.TensorData(data=[-1.0] * tokens, dtype="float32", shape=[tokens]),
        "advantages": types.TensorData(data=adv, dtype="float32", shape=[tokens])})
    fb = types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn, loss_fn_config=config)
    req = ForwardBackwardRequest(forward_backward_input=fb, model_id=model_id, seq_id=seq_id)
    msg = forward_backward_request_to_proto(req)
    if forward_only:
        msg.forward_only = True
    return msg.SerializeToString()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve_state"), "--max-num-samples", "16", "--max-lora-rank", "16",
               "--max-json-body-mb", "1", "--max-proto-body-mb", "4", "--max-models-per-key", "3")
    yield s
    s.stop()


# ----------------------------------------------------------------------------- custom-loss graphs
def _graph(target: str, args: list, op: str = "call_function", kwargs: dict | None = None) -> types.CustomLossGraph:
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
             {"op": op, "name": "evil", "target": target, "args": args, "kwargs": kwargs or {}},
             {"op": "call_function", "name": "s", "target": "torch.sum", "args": [{"ref": "logprobs"}], "kwargs": {}},
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}], "kwargs": {}}]
    return types.CustomLossGraph.model_validate({"nodes": nodes})


ATTACKS = {
    "torch.os.system": ("torch.os.system", ["touch CANARY"]),
    "torch.load": ("torch.load", ["CANARY"]),
    "torch.save": ("torch.save", [{"ref": "logprobs"}, "CANARY"]),
    "builtins.eval": ("builtins.eval", ["open('CANARY', 'w')"]),
    "builtins.exec": ("exec", ["open('CANARY', 'w')"]),
    "attrgetter chain": ("operator.attrgetter", ["__class__.__init__.__globals__"]),
    "nested attribute": ("torch.nn.functional.torch.os.system", ["touch CANARY"]),
    "cpp_extension": ("torch.utils.cpp_extension.load_inline", ["x", "int f(){return 0;}"]),
    "getattr dunder": ("getattr", [{"ref": "logprobs"}, "__class__"]),
}


@pytest.mark.parametrize("name", ATTACKS)
def test_graph_with_a_target_outside_the_table_is_refused(name):
    target, args = ATTACKS[name]
    with pytest.raises(ValueError, match="not allow|only"):
        wire.rebuild_graph(_graph(target, args))


@pytest.mark.parametrize("node", [
    {"op": "call_method", "target": "__reduce_ex__", "args": [{"ref": "logprobs"}, 2]},
    {"op": "call_method", "target": "repeat", "args": [{"ref": "logprobs"}, 10**9]},
    {"op": "call_method", "target": "copy_", "args": [{"ref": "logprobs"}, {"ref": "logprobs"}]},
    {"op": "call_function", "target": "torch.sum", "args": [{"layout": "os"}]},
    {"op": "call_function", "target": "torch.sum", "args": [{"ref": "logprobs"}],
     "kwargs": {"dim=0) or __import__('os').system('touch CANARY'); (x": 0}},
    {"op": "get_attr", "target": "os", "args": []},
])
def test_graph_with_a_refused_method_argument_or_op_is_refused(node):
    with pytest.raises(ValueError):
        wire.rebuild_graph(_graph(node["target"], node["args"], op=node["op"], kwargs=node.get("kwargs")))


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "loss").glob("*.yaml")))
@pytest.mark.parametrize("extra", [[], ["loss.kl_coef=0.1"]], ids=["", "kl"])
def test_every_project_loss_traced_by_the_sdk_is_accepted(name, extra):
    """The tables are closed, so they must hold what the project's own one-pass losses call."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from trainer.config.compose import run_config
    from trainer.losses.build import build_loss
    from trainer.losses.per_datum import make_per_datum_fn

    cfg = run_config([f"loss={name}", "loss.aggregation=sum", *extra])
    per_datum = make_per_datum_fn(build_loss(cfg.loss))
    graph = encode_graph(trace_loss(per_datum.fn, per_datum.input_ranks, "s"))
    wire.rebuild_graph(graph)


def test_the_tables_hold_function_objects_of_allowed_modules_only():
    for name, fn in FUNCTIONS.items():
        assert callable(fn), name
        module = (getattr(fn, "__module__", None) or "").split(".")[0]
        assert module in ("torch", "math", "operator", "_operator", "trainer"), (name, module)
    for banned in ("torch.save", "torch.load", "operator.attrgetter", "operator.methodcaller", "torch.zeros",
                   "torch.full", "torch.randn"):
        assert banned not in FUNCTIONS


def test_rce_graph_over_the_wire_is_refused_and_runs_nothing(server, tmp_path):
    canary = tmp_path / "PWNED"
    c = Raw(server.url, "tml-attacker")
    model_id = c.model()
    req = types.CreateCustomLossRequest(session_id=c.session, custom_loss_seq_id=0, name="pwn",
                                        inputs=[types.CustomLossInput(name="logprobs", rank=1)],
                                        graph=_graph("torch.os.system", [f"id > {canary}"]))
    r = c.post("create_custom_loss", req)
    assert r.status_code == 400 and "torch.os.system" in r.json()["detail"]
    # the loss was never stored: using its id fails as an unknown loss, and nothing ran
    fut = c.fwdbwd(model_id, 0, loss_fn="custom", config={"loss_id": f"{c.session}:loss:0"}).json()
    out = c.result(fut["request_id"]).json()
    assert out["category"] == "user" and "unknown custom loss" in out["error"]
    time.sleep(0.5)
    assert not canary.exists()


def test_allowed_server_side_custom_loss_still_trains(server):
    """An SDK-traced loss (server-side) gives the same loss as the built-in it restates."""
    import tinker

    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-custom")
    try:
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()

        def loss(logprobs, weights):
            return -(logprobs * weights).sum(), {}

        handle = sc.create_custom_loss(loss, {"logprobs": 1, "weights": 1}).result()
        assert handle.loss_id is not None  # uploaded, run server-side
        datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={
            "target_tokens": types.TensorData(data=[6, 7, 8], dtype="int64", shape=[3]),
            "weights": types.TensorData(data=[1.0, 0.5, 1.0], dtype="float32", shape=[3])})
        custom = tc.forward_backward_custom([datum], handle).result()
        builtin = tc.forward([datum], "cross_entropy").result()
        assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-5)
    finally:  # a session left open heartbeats at this module's server long after it stopped
        sc.close("success").result(timeout=10)


# ----------------------------------------------------------------------------- keys and isolation
def test_a_second_key_cannot_see_or_touch_a_model(server):
    alice, bob = Raw(server.url, "tml-alice"), Raw(server.url, "tml-bob")
    model_id = alice.model()
    fut = alice.fwdbwd(model_id, 0).json()
    assert bob.post("get_info", types.GetInfoRequest(model_id=model_id)).status_code == 404
    r = bob.post("optim_step", types.OptimStepRequest(model_id=model_id, seq_id=1,
                                                      adam_params=types.AdamParams(learning_rate=0.5)))
    assert r.status_code == 404 and "unknown model_id" in r.json()["detail"]
    assert bob.fwdbwd(model_id, 1, forward_only=True).status_code == 404
    assert bob.post("retrieve_future", types.FutureRetrieveRequest(request_id=fut["request_id"])).status_code == 404
    r = bob.post("create_model", types.CreateModelRequest(session_id=alice.session, model_seq_id=5, base_model=BASE))
    assert r.status_code == 404  # another key's session cannot hold bob's models
    # alice's own next request is hers: seq 1 was not taken by bob
    second = alice.fwdbwd(model_id, 1).json()
    assert second["request_id"] != fut["request_id"]
    assert alice.result(second["request_id"]).status_code == 200


def test_heartbeat_is_410_for_a_finished_or_foreign_session(server):
    """410 is the service's word for a session that is over: the SDK's heartbeat loop stops on it instead of
    heartbeating (and warning) for the life of the process."""
    alice, bob = Raw(server.url, "tml-alice"), Raw(server.url, "tml-bob")
    beat = types.SessionHeartbeatRequest(session_id=alice.session)
    assert alice.ok("session_heartbeat", beat) == {"type": "session_heartbeat"}
    assert bob.post("session_heartbeat", beat).status_code == 410
    assert alice.ok(f"sessions/{alice.session}/finish", {"reason": {"type": "success"}}) is None
    r = alice.post("session_heartbeat", beat)
    assert r.status_code == 410 and "finished or unknown" in r.json()["detail"]


def test_stats_and_api_need_a_key(server):
    assert httpx.get(server.url + "/stats", timeout=10).status_code == 401
    r = httpx.post(server.url + "/api/v1/create_session", json={}, headers={"X-API-Key": "tml-"}, timeout=10)
    assert r.status_code == 401 and "detail" in r.json()


def test_a_replayed_seq_id_with_another_body_is_refused(server):
    c = Raw(server.url, "tml-replay")
    model_id = c.model()
    first = c.fwdbwd(model_id, 0).json()
    again = c.fwdbwd(model_id, 0).json()  # an identical resend: the first reply
    assert again == first
    r = c.fwdbwd(model_id, 0, forward_only=True)  # same seq_id, another request
    assert r.status_code == 409 and r.headers["x-should-retry"] == "false"
    r = c.post("optim_step", types.OptimStepRequest(model_id=model_id, seq_id=0, adam_params=types.AdamParams()))
    assert r.status_code == 409


def test_error_bodies_are_json_even_with_quotes(server):
    c = Raw(server.url, "tml-quotes")
    r = c.post("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=c.session, sampling_session_seq_id=0, model_path='tinker://it\'s "quoted"/weights/x'))
    assert 400 <= r.status_code < 500
    assert isinstance(json.loads(r.text)["detail"], str)
    r = c.http.post("/get_info", content=b'{"model_id": "a\\"b', headers={"content-type": "application/json"})
    assert r.status_code == 400 and isinstance(r.json()["detail"], str)


# ----------------------------------------------------------------------------- limits and numbers
def test_nan_inf_and_out_of_range_numbers_are_refused(server):
    c = Raw(server.url, "tml-numbers")
    model_id = c.model()
    for lr in (float("nan"), 1e308, -1.0):
        body = types.OptimStepRequest(model_id=model_id, seq_id=9, adam_params=types.AdamParams(learning_rate=lr))
        r = c.http.post("/optim_step", content=body.model_dump_json(), headers={"content-type": "application/json"})
        assert r.status_code == 400 and "learning_rate" in r.json()["detail"], (lr, r.text)
    r = c.fwdbwd(model_id, 10, advantages=[1.0, float("nan"), 0.0])
    assert r.status_code == 400 and "NaN" in r.json()["detail"]
    r = c.fwdbwd(model_id, 11, loss_fn="ppo", config={"clip_low_threshold": float("inf")})
    assert r.status_code == 400
    sid = c.ok("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=model_id, seq_id=12, sampling_session_seq_id=0))
    c.result(sid["request_id"])
    sampler = f"{c.session}:sample:0"
    for params in ({"temperature": float("nan")}, {"top_p": float("nan")}, {"temperature": 1e308}):
        body = types.SampleRequest(num_samples=1, prompt=types.ModelInput.from_ints([5, 6]), sampling_session_id=sampler,
                                   seq_id=1, sampling_params=types.SamplingParams(max_tokens=2, **params))
        r = c.http.post("/asample", content=body.model_dump_json(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (params, r.text)
    # the model is intact: a good step still trains
    assert c.result(c.fwdbwd(model_id, 13).json()["request_id"]).status_code == 200


def test_each_limit_is_a_4xx_while_a_good_client_keeps_its_pace(server):
    good, bad = Raw(server.url, "tml-good"), Raw(server.url, "tml-bad")
    model_id = good.model()

    def step(seq: int) -> float:
        t = time.perf_counter()
        assert good.result(good.fwdbwd(model_id, seq).json()["request_id"]).status_code == 200
        return time.perf_counter() - t

    baseline = sorted(step(s) for s in range(5))[2]
    seqs = iter(range(100, 10_000))
    during: list[float] = []
    stop = threading.Event()

    def good_loop() -> None:
        while not stop.is_set():
            during.append(step(next(seqs)))

    t = threading.Thread(target=good_loop)
    t.start()
    try:
        bad_model = bad.model()
        cases = []
        # bodies over the endpoint's limit: 413 from the Content-Length, before any read
        cases.append(bad.http.post("/create_session", content=b"x" * (2 * 2**20),
                                   headers={"content-type": "application/json"}))
        big = fwdbwd_body("no-such-model", 0, tokens=300_000)  # ~4.8 MB > 4 MB
        cases.append(bad.http.post("/forward_backward", content=big, headers={"content-type": "application/x-protobuf"}))
        # under the body limit but for an unknown model: refused before decoding
        mid = fwdbwd_body("no-such-model", 0, tokens=200_000)
        t0 = time.perf_counter()
        r = bad.http.post("/forward_backward", content=mid, headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 404 and time.perf_counter() - t0 < 2.0
        # sizes a request names
        cases.append(bad.post("create_model", types.CreateModelRequest(
            session_id=bad.session, model_seq_id=1, base_model=BASE, lora_config=types.LoraConfig(rank=10**7))))
        sid = bad.ok("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
            model_id=bad_model, seq_id=0, sampling_session_seq_id=0))
        bad.result(sid["request_id"])
        sampler = f"{bad.session}:sample:0"
        for n, max_tokens, prompt in ((2_000_000, 4, 2), (2, 10**6, 2), (2, 4, 10_000)):
            cases.append(bad.post("asample", types.SampleRequest(
                num_samples=n, prompt=types.ModelInput.from_ints([5] * prompt), sampling_session_id=sampler, seq_id=n,
                sampling_params=types.SamplingParams(max_tokens=max_tokens))))
        for seq in range(2, 4):  # the key's model slots: 3 (two more allowed), then refused
            bad.model(seq=seq)
        cases.append(bad.post("create_model", types.CreateModelRequest(
            session_id=bad.session, model_seq_id=9, base_model=BASE, lora_config=types.LoraConfig(rank=4))))
    finally:
        stop.set()
        t.join()
    for r in cases:
        assert r.status_code in (413, 400), (r.status_code, r.text[:300])
        assert "limit" in r.json()["detail"]
    assert len(during) >= 3
    assert max(during) < max(10 * baseline, 2.0), (baseline, during)


# ----------------------------------------------------------------------------- start-up policy and restarts
def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.serve", *args], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})


def test_non_loopback_host_needs_a_key():
    p = _serve("--host", "0.0.0.0", "--port", "0")
    assert p.returncode == 2 and "--api-key" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = _serve("--host", "127.0.0.1", "--api-key", "short")
    assert p.returncode == 2 and "tml-" in p.stderr


def test_insecure_allow_remote_warns(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--host", "0.0.0.0", "--port", "0",
                             "--insecure-allow-remote", "--state-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout.readline().startswith("listening on http://0.0.0.0:")  # nothing connects to it
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "WARNING" in err and "insecure-allow-remote" in err


def test_api_key_is_the_only_key_and_ids_change_across_restarts(tmp_path):
    key = "tml-secret-0123456789"
    s = Server(tmp_path, "--api-key", key)
    try:
        assert Raw.__new__(Raw) is not None
        r = httpx.post(s.url + "/api/v1/create_session", json={"sdk_version": "x", "tags": [], "user_metadata": None},
                       headers={"X-API-Key": "tml-other-0123456789"}, timeout=10)
        assert r.status_code == 401
        for headers in ({}, {"X-API-Key": ""}):  # no key at all is refused too, not only a wrong one
            r = httpx.post(s.url + "/api/v1/create_session", json={"sdk_version": "x", "tags": [],
                                                                    "user_metadata": None},
                           headers=headers, timeout=10)
            assert r.status_code == 401, (headers, r.status_code)
            assert httpx.get(s.url + "/stats", headers=headers, timeout=10).status_code == 401
        first = Raw(s.url, key)
        model_id = first.model()
        fut = first.fwdbwd(model_id, 0).json()["request_id"]
        port = s.url.rsplit(":", 1)[1]
    finally:
        s.stop()
    s = Server(tmp_path, "--api-key", key, "--port", port)
    try:
        second = Raw(s.url, key)
        assert second.session != first.session
        second.http, first.http = second.http, httpx.Client(base_url=s.url + "/api/v1", headers={"X-API-Key": key})
        assert second.model() != model_id
        # the old client's ids mean nothing to the new server
        assert first.post("get_info", types.GetInfoRequest(model_id=model_id)).status_code == 404
        assert first.post("retrieve_future", types.FutureRetrieveRequest(request_id=fut)).status_code == 404
        r = first.post("create_model", types.CreateModelRequest(session_id=first.session, model_seq_id=0, base_model=BASE))
        assert r.status_code == 404 and "before a restart" in r.json()["detail"]
    finally:
        s.stop()


def test_loopback_check():
    from trainer.serve import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.8.0.1")
    assert is_loopback("localhost") and is_loopback("::1%lo")
    assert not is_loopback("10.0.0.1") and not is_loopback("192.168.1.5") and not is_loopback(None)
    assert not is_loopback("not-an-address") and not is_loopback("0.0.0.0")
