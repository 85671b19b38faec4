"""Acceptance under load (issue 52): with 300 connections trickling request bodies and the costliest
training graph the cost check admits running, the server still answers a health check within 2 s and
another key's 2-sample request within 3x its time alone.

A real `python -m trainer.serve` on 127.0.0.1 with its default limits (tiny model, the engine flags every
server test uses); everything is driven over loopback, every loop is bounded in count and time, and the
whole test stops within `BUDGET_S`.

The graph: four `torch.cat` nodes over as many references to the datum's logprobs as the graph cap allows,
on as many 64-token datums as the request limits and `--max-loss-cost` admit (all 4096 the limits allow, at
this commit's constants). The cost model's first fit priced `cat` over many references lowest against its
measured time of every graph family (bench/README.md, "Custom-loss cost model": predicted / measured 0.02
with the module's constant, against 0.12 for chains of cheap nodes), so it is the costliest request the
cost check admits.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time

import httpx
import pytest
import torch
from test_serve_connections import _closed, _Server, _trickler
from test_serve_security import BASE, Raw
from test_serve_sessions import _call, _graph
from tinker import types
from tinker.proto.request_conv import ForwardBackwardRequest, forward_backward_request_to_proto

from trainer.serve import graph_cost, wire
from trainer.serve.limits import Limits

TRICKLES = 300
BUDGET_S = 110.0  # the whole test, server start to stop
HEALTH_S = 2.0
SLOWDOWN = 3.0
TOKENS = Limits().batch_tokens // Limits().batch_datums  # every datum at the same length, the request full
REFS = (graph_cost.MAX_GRAPH_REFS - 2) // 4  # four cats, and the sum and output refer to one node each


def _cat_graph() -> types.CustomLossGraph:
    cats = [_call(f"c{i}", "torch.cat", [{"ref": "logprobs"}] * REFS) for i in range(4)]
    return _graph([*cats, _call("loss", "torch.sum", {"ref": "c3"})])


def _most_datums(graph: types.CustomLossGraph) -> int:
    """The most datums of `TOKENS` tokens the request limits and the server's default cost bound admit (its
    own check, on the shapes the server reads from the request; a request costs its datums times one's)."""
    gm, limits = wire.rebuild_graph(graph), Limits()
    graph_cost.check_at_upload(gm, [1], limits)
    datum = [((TOKENS,), torch.float32)]
    n = min(limits.batch_datums, limits.loss_cost // graph_cost.check_request(gm, [datum], limits))
    assert n >= 1 and n * TOKENS <= limits.batch_tokens
    assert graph_cost.check_request(gm, [datum] * n, limits) <= limits.loss_cost
    if n < limits.batch_datums:  # the cost bound, not the request limits, stopped it: one more is refused
        with pytest.raises(graph_cost.CostExceeded):
            graph_cost.check_request(gm, [datum] * (n + 1), limits)
    return n


def _custom_body(model_id: str, loss_id: str, datums: int) -> bytes:
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 5 + TOKENS))), loss_fn_inputs={
        "target_tokens": types.TensorData(data=list(range(6, 6 + TOKENS)), dtype="int64", shape=[TOKENS])})
        for _ in range(datums)]
    fb = types.ForwardBackwardInput(data=data, loss_fn="custom", loss_fn_config={"loss_id": loss_id})
    req = ForwardBackwardRequest(forward_backward_input=fb, model_id=model_id, seq_id=0)
    return forward_backward_request_to_proto(req).SerializeToString()


def _sample_s(c: Raw, sampler: str, seq: int, deadline: float) -> float:
    """Seconds from posting a 2-sample request to its result (inf if none came by `deadline`)."""
    t = time.monotonic()
    rid = c.ok("asample", types.SampleRequest(
        sampling_session_id=sampler, seq_id=seq, num_samples=2, prompt=types.ModelInput.from_ints([5, 6, 7]),
        sampling_params=types.SamplingParams(max_tokens=16, seed=seq, temperature=1.0)))["request_id"]
    while time.monotonic() < deadline:  # each poll waits at most the server's poll_s for the result
        r = c.post("retrieve_future", types.FutureRetrieveRequest(request_id=rid))
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return time.monotonic() - t
        assert r.status_code == 200 and r.json().get("type") == "try_again", r.text
    return float("inf")


def _inflight(server: _Server, key: str) -> int:
    return httpx.get(server.url + "/stats", headers={"X-API-Key": key}, timeout=10).json()["key"]["inflight"]


def _raise_nofile(need: int) -> None:
    """This process opens one descriptor per trickle: raise the soft limit within the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is under the {need} descriptors this test opens")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class _Trickles:
    """`n` connections, each sending a body a byte per `every_s`; one the server closes is replaced, so
    about `n` trickle the whole time. Stops at `stop()` or at `deadline` (monotonic)."""

    def __init__(self, port: int, n: int, deadline: float, every_s: float = 0.5):
        self.port, self.n, self.deadline, self.every_s = port, n, deadline, every_s
        self.socks: list[socket.socket] = []
        self.opened = self.replaced = 0
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        with contextlib.suppress(OSError):
            self.socks.append(_trickler(self.port, "tml-trickle"))
            self.opened += 1

    def _run(self) -> None:
        for _ in range(self.n):
            if self._stop.is_set() or time.monotonic() > self.deadline:
                break
            self._open()
        self.ready.set()
        while not self._stop.is_set() and time.monotonic() < self.deadline:
            for s in list(self.socks):
                if _closed(s):
                    s.close()
                    self.socks.remove(s)
                    continue
                with contextlib.suppress(OSError):
                    s.sendall(b" ")
            for _ in range(self.n - len(self.socks)):
                self._open()
                self.replaced += 1
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)
        for s in self.socks:
            s.close()


@pytest.mark.slow
def test_health_and_another_keys_sample_stay_fast_under_trickles_and_the_costliest_graph(tmp_path):
    t0 = time.monotonic()
    deadline = t0 + BUDGET_S
    _raise_nofile(TRICKLES + 256)
    graph = _cat_graph()
    datums = _most_datums(graph)
    server = _Server(tmp_path)
    trickles = None
    a = None
    try:
        b = Raw(server.url, "tml-load-b")
        sampler = b.ok("create_sampling_session", types.CreateSamplingSessionRequest(
            session_id=b.session, sampling_session_seq_id=0, base_model=BASE))["sampling_session_id"]
        _sample_s(b, sampler, 0, deadline)  # the first batch builds what later ones reuse
        alone = min(_sample_s(b, sampler, seq, deadline) for seq in (1, 2))

        a = Raw(server.url, "tml-load-a")
        model = a.model()
        reply = a.ok("create_custom_loss", types.CreateCustomLossRequest(
            session_id=a.session, custom_loss_seq_id=0, name="cat-refs", graph=graph,
            inputs=[types.CustomLossInput(name="logprobs", rank=1)]))
        loss_id = a.result(reply["request_id"]).json()["loss_id"]
        r = a.http.post("/forward_backward", content=_custom_body(model, loss_id, datums),
                        headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 200, r.text  # admitted: the cost check lets it through
        assert _inflight(server, "tml-load-a") == 1

        trickles = _Trickles(server.port, TRICKLES, deadline)
        assert trickles.ready.wait(max(1.0, deadline - time.monotonic() - 30)), "the trickles did not open"
        assert trickles.opened >= TRICKLES, trickles.opened
        health = [server.health_s()]
        under = _sample_s(b, sampler, 3, deadline)
        health.append(server.health_s())
        open_now = len(trickles.socks)
        # the adversarial request was running (or queued behind its own micro-batches) the whole time
        assert _inflight(server, "tml-load-a") == 1, "the graph finished before the measurement ended"
    finally:
        if trickles is not None:
            trickles.stop()
        if a is not None:  # its session's end cancels the graph's remaining micro-batches
            with contextlib.suppress(httpx.HTTPError):
                a.post(f"sessions/{a.session}/finish", {"reason": {"type": "success"}})
        server.proc.kill()
        server.proc.communicate(timeout=30)
        server.err.close()
    took = time.monotonic() - t0
    print(f"datums={datums} alone={alone:.2f}s under={under:.2f}s health={[round(h, 2) for h in health]} "
          f"trickles open={open_now} opened={trickles.opened} total={took:.0f}s")
    assert took < BUDGET_S + 30
    assert max(health) < HEALTH_S, health
    assert under < SLOWDOWN * alone, (under, alone)
