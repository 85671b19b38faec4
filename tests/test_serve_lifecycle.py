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
        from trainer.serve.app import JsonErrorRunner, TinkerServer

        from trainer.backends.local.engine import shared_base

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
            self.url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
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
