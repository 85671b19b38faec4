"""A session's life on `trainer.serve`: what keeps it alive, and what its end releases.

Expiry tests run the real server (`TinkerServer` behind aiohttp on 127.0.0.1) inside the test process,
since `python -m trainer.serve` refuses a `--session-timeout-s` under the SDK's 10 s heartbeat and a
quick test cannot wait that long; everything else runs the server as a subprocess, as a user does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_security import BASE, Raw
from tinker import types

from trainer.serve.limits import Limits


class InProcessServer:
    """`TinkerServer` (real HTTP, loopback) on an event loop of its own thread, with any session timeout."""

    def __init__(self, state_dir: Path, session_timeout_s: float, limits: Limits | None = None):
        from aiohttp import web

        from trainer.backends.local import LocalServiceClient
        from trainer.backends.local.engine import shared_base
        from trainer.serve.app import TinkerServer
        from trainer.serve.connections import JsonErrorRunner

        self.engine = LocalServiceClient(state_dir=state_dir, sampler_dtype="float32", train_dtype="float32")
        shared_base(BASE)  # loaded before any session starts its 2 s clock
        self.server = TinkerServer(self.engine, poll_s=2.0, session_timeout_s=session_timeout_s,
                                   limits=limits)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.runner = JsonErrorRunner(self.server.app(), access_log=None, handle_signals=False)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(60), "the in-process server did not start"

    def stats(self, key: str) -> dict:
        return httpx.get(self.url + "/stats", headers={"X-API-Key": key}, timeout=30).json()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.engine.close()


@pytest.fixture
def short_sessions(tmp_path):
    s = InProcessServer(tmp_path / "state", session_timeout_s=2.0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from local_client import local_service_client

    yield from local_service_client(tmp_path_factory, "lifecycle_engine", micro_batch_size=1)


def test_a_cancelled_training_client_stops_between_micro_batches_and_drops_its_queue(engine):
    """A custom loss cancels its own client between Tinker's two passes: the request fails with
    RequestCancelled before the second pass's first micro-batch, the request queued behind it never
    starts, and a later one is refused at once."""
    import concurrent.futures

    import torch

    from trainer.backends.local.common import RequestCancelled

    tc = engine.create_lora_training_client(BASE, rank=4, seed=0).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8]}) for _ in range(3)]  # 3 micro-batches
    ran = []

    def loss(batch, logprobs):  # runs between the passes, on the engine's compute thread
        ran.append("loss")
        tc.cancel()
        return sum(lp.sum() for lp in logprobs), {}

    running = tc.forward_backward_custom(data, loss)
    queued = tc.forward_backward(data, "cross_entropy")
    with pytest.raises(RequestCancelled):
        running.result(timeout=120)
    assert ran == ["loss"]
    with pytest.raises((RequestCancelled, concurrent.futures.CancelledError)):
        queued.result(timeout=30)
    assert all(p.grad is None or not torch.any(p.grad) for p in tc.compute.params)  # no pass-2 backward
    with pytest.raises(RequestCancelled):
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result(timeout=30)


def test_sampling_takes_its_turns_between_a_training_requests_micro_batches(engine):
    """A forward_backward of 192 one-datum micro-batches, then another tenant's 1-token sample: the sample
    is answered while the training request is still running (it waits for a micro-batch, not for the
    whole request). The request is long enough (seconds) that a loaded machine's scheduling noise cannot
    let it finish before the sample arrives, as 24 micro-batches (0.3 s) sometimes did."""
    tc = engine.create_lora_training_client(BASE, rank=4, seed=1).result()
    sampler = engine.create_sampling_client(base_model=BASE)
    sampler.tenant = "other"
    prompt = types.ModelInput.from_ints([5, 6])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result(timeout=120)  # warm
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 21))),
                        loss_fn_inputs={"target_tokens": list(range(6, 22))}) for _ in range(192)]
    tc.forward(data[:1], "cross_entropy").result(timeout=120)  # warm
    training = tc.forward_backward(data, "cross_entropy")
    time.sleep(0.2)  # its first micro-batches are on the compute thread
    t = time.monotonic()
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result(timeout=300)
    waited = time.monotonic() - t
    assert len(out.sequences) == 1
    assert not training.future().done(), "the sample waited for the whole training request"
    t = time.monotonic()
    assert training.result(timeout=600).metrics["engine/micro_batches:sum"] == 192
    print(f"sample {waited:.2f} s; training ran on for {time.monotonic() - t:.2f} s")


def _sample(raw: Raw, sampler: str, seq: int, max_tokens: int = 1, n: int = 1) -> dict:
    return raw.ok("asample", types.SampleRequest(
        num_samples=n, prompt=types.ModelInput.from_ints([5, 6]), sampling_session_id=sampler, seq_id=seq,
        sampling_params=types.SamplingParams(max_tokens=max_tokens, stop=[])))


def test_any_request_of_a_session_keeps_it_alive_without_heartbeats(short_sessions):
    """--session-timeout-s 2: a raw-HTTP session that samples or reads its sampler every 0.5 s for 4 s, and
    never heartbeats, stays alive; a session left idle as long expires."""
    srv = short_sessions
    busy, idle = Raw(srv.url, "tml-busy"), Raw(srv.url, "tml-idle")
    sampler = busy.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=busy.session, sampling_session_seq_id=0, base_model=BASE))["sampling_session_id"]
    end = time.monotonic() + 4.0
    seq = 0
    while time.monotonic() < end:  # 8 requests, none a heartbeat
        if seq % 2:
            assert busy.http.get(f"/samplers/{sampler}").status_code == 200
        else:
            _sample(busy, sampler, seq)
        seq += 1
        time.sleep(0.5)
    assert srv.stats("tml-busy")["key"]["sessions"] == 1
    assert srv.stats("tml-busy")["expired_sessions"] == 1  # the idle one
    r = idle.post("session_heartbeat", types.SessionHeartbeatRequest(session_id=idle.session))
    assert r.status_code == 410, r.text
    r = busy.post("session_heartbeat", types.SessionHeartbeatRequest(session_id=busy.session))
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- a session's end stops its work
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve_sessions import MAX_RSS_KB, _peak_rss_kb
    from test_tinker_wire import Server

    s = Server(tmp_path_factory.mktemp("lifecycle_state"), "--num-threads", "1", "--max-samplers-per-session",
               "3", "--max-samplers", "5", "--max-models", "3")
    yield s
    assert _peak_rss_kb(s) < MAX_RSS_KB
    s.stop()


def _wait_for(what: str, check, bound_s: float) -> float:
    """Seconds until `check()` holds (polled every 0.2 s), or an AssertionError naming `what` after
    `bound_s`."""
    t = time.monotonic()
    while not check():
        assert time.monotonic() - t < bound_s, f"{what}: not within {bound_s} s"
        time.sleep(0.2)
    return time.monotonic() - t


def test_finishing_a_session_cancels_its_queued_and_running_work(server):
    """Key A queues four long sampling requests (minutes of decoding on two shared cores) and training
    behind a slow one, then finishes its session: within 10 s nothing of it is in flight, and the engine's
    sampler is neither decoding nor queuing anything; the key can work again at once."""
    key = "tml-walks-away"
    raw = Raw(server.url, key)
    model = raw.model(0)
    sampler = raw.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=raw.session, sampling_session_seq_id=0, base_model=BASE))["sampling_session_id"]
    for i in range(4):
        _sample(raw, sampler, i, max_tokens=500, n=64)
    from test_serve_security import fwdbwd_body

    for seq in range(3):  # queued on the model's ordered worker, behind each other
        body = fwdbwd_body(model, seq, tokens=600)
        r = raw.http.post("/forward_backward", content=body,
                          headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
    mine = httpx.get(server.url + "/stats", headers={"X-API-Key": key}, timeout=30).json()
    assert mine["key"]["inflight"] >= 4, mine  # the samples at least; the training may have run
    _wait_for("the sampler starts decoding", lambda: httpx.get(
        server.url + "/stats", headers={"X-API-Key": key}, timeout=30).json()["sampler"]["running"] > 0, 120)
    assert raw.ok(f"sessions/{raw.session}/finish", {"reason": {"type": "success"}}) is None

    def idle() -> bool:
        s = httpx.get(server.url + "/stats", headers={"X-API-Key": key}, timeout=30).json()
        return s["key"]["inflight"] == 0 and s["sampler"] == {"queued": 0, "queued_rows": 0, "running": 0,
                                                              "running_rows": 0}

    took = _wait_for("the finished session's work stops", idle, 10)
    print(f"in flight 0 {took:.1f} s after finish")
    again = Raw(server.url, key)
    sampler = again.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=again.session, sampling_session_seq_id=0, base_model=BASE))["sampling_session_id"]
    out = again.result(_sample(again, sampler, 0, max_tokens=2)["request_id"])
    assert out.status_code == 200
    again.ok(f"sessions/{again.session}/finish", {"reason": {"type": "success"}})


def _stats(server, key: str) -> dict:
    return httpx.get(server.url + "/stats", headers={"X-API-Key": key}, timeout=30).json()


def _snapshot_sampler(raw: Raw, model: str, seq: int) -> str:
    reply = raw.ok("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=model, seq_id=seq, sampling_session_seq_id=seq))
    out = raw.result(reply["request_id"])
    assert out.status_code == 200 and "error" not in out.json(), out.text
    return out.json()["sampling_session_id"]


def test_samplers_are_capped_per_session_and_server_wide_and_freed_with_their_session(server):
    """--max-samplers-per-session 3, --max-samplers 5. A fourth snapshot sampler retires the session's least
    recently used idle one (whose id then answers 404 naming the flag); with all three busy it is a 413
    naming the flag. Samplers of one checkpoint share one snapshot; past 5 on the server a new one is a
    413 naming --max-samplers (and, without --api-key, how to get per-user limits). When the sessions end
    the server holds no sampler and no snapshot, and its RSS stays bounded."""
    key = "tml-samplers"
    a = Raw(server.url, key)
    model = a.model(0)
    first, second, third = (_snapshot_sampler(a, model, i) for i in range(3))
    _sample(a, second, 0)  # used: the first is now the least recently used
    a.result(_sample(a, third, 0)["request_id"])
    fourth = _snapshot_sampler(a, model, 3)
    r = a.post("asample", types.SampleRequest(
        num_samples=1, prompt=types.ModelInput.from_ints([5, 6]), sampling_session_id=first, seq_id=1,
        sampling_params=types.SamplingParams(max_tokens=1)))
    assert r.status_code == 404 and "--max-samplers-per-session" in r.json()["detail"], r.text
    assert _stats(server, key)["samplers"] == 3
    for i, sid in enumerate((second, third, fourth)):  # all three busy for minutes
        _sample(a, sid, 10 + i, max_tokens=500, n=64)
    r = a.post("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=model, seq_id=4, sampling_session_seq_id=4))
    assert r.status_code == 413 and "--max-samplers-per-session" in r.json()["detail"], r.text

    path = a.result(a.ok("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=model, seq_id=5, path="shared"))["request_id"]).json()["path"]
    b = Raw(server.url, key)  # the key's second session
    before = _stats(server, key)["memory"]["snapshots"]
    for seq in range(2):
        b.ok("create_sampling_session", types.CreateSamplingSessionRequest(
            session_id=b.session, sampling_session_seq_id=seq, model_path=path))
    mem = _stats(server, key)["memory"]
    assert mem["snapshots"] == before + 1, mem  # one copy of the checkpoint for both
    r = b.post("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=b.session, sampling_session_seq_id=2, base_model=BASE))
    detail = r.json()["detail"]
    assert r.status_code == 413 and "--max-samplers" in detail and "--api-key-file" in detail, r.text

    for raw in (a, b):
        assert raw.ok(f"sessions/{raw.session}/finish", {"reason": {"type": "success"}}) is None

    def released() -> bool:
        s = _stats(server, key)
        return (s["samplers"] == 0 and s["memory"]["snapshots"] == 0 and s["memory"]["merged_cached"] == 0
                and s["key"]["inflight"] == 0)

    _wait_for(f"the ended sessions' samplers are dropped ({_stats(server, key)})", released, 15)
    mem = _stats(server, key)["memory"]
    assert 0 < mem["rss_mb"] < 2048, mem


def test_invented_keys_share_one_server_wide_budget(server):
    """Without --api-key (--max-models 3): three keys' models fill the server, and a fourth key, however
    new, is refused naming --max-models and how to get per-user limits (--api-key-file)."""
    raws = [Raw(server.url, f"tml-invented-{i}") for i in range(4)]
    raws[0].model(0)
    raws[0].model(1)
    raws[1].model(0)
    r = raws[2].post("create_model", types.CreateModelRequest(
        session_id=raws[2].session, model_seq_id=0, base_model=BASE, lora_config=types.LoraConfig(rank=4)))
    detail = r.json()["detail"]
    assert r.status_code == 413 and "(--max-models)" in detail and "--api-key-file" in detail, r.text
    assert raws[0].ok(f"sessions/{raws[0].session}/finish", {"reason": {"type": "success"}}) is None
    raws[3].model(0)  # the finished session's places are free again
    for raw in raws:
        raw.ok(f"sessions/{raw.session}/finish", {"reason": {"type": "success"}})


@pytest.mark.parametrize("flag", ["--max-models-per-key", "--max-samplers-per-session", "--max-samplers",
                                  "--max-models"])
def test_a_bad_limit_is_refused_naming_its_flag(flag, capsys):
    from trainer.serve.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([flag, "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().endswith(f"error: {flag} must be a positive number, got 0"), err


def test_an_expired_session_cancels_its_work(short_sessions):
    """--session-timeout-s 2: a session that queues a long sampling request and then goes silent expires,
    and its request stops decoding within seconds (nothing in flight for the key, the sampler idle)."""
    srv = short_sessions
    raw = Raw(srv.url, "tml-silent")
    sampler = raw.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=raw.session, sampling_session_seq_id=0, base_model=BASE))["sampling_session_id"]
    _sample(raw, sampler, 0, max_tokens=500, n=64)
    _sample(raw, sampler, 1, max_tokens=500, n=64)
    assert srv.stats("tml-silent")["key"]["inflight"] == 2

    def idle() -> bool:
        s = srv.stats("tml-silent")
        return s["key"]["inflight"] == 0 and s["sampler"]["running"] == 0 and s["sampler"]["queued"] == 0

    _wait_for("the expired session's work stops", idle, 8)
    assert srv.stats("tml-silent")["expired_sessions"] == 1
