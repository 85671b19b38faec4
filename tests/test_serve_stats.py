"""`/stats` counts work in flight per key: the asking key sees its own accepted requests whose result is not
ready (`key.inflight`), never another key's, beside the server-wide total (`inflight`). A real
`python -m trainer.serve` on 127.0.0.1, raw HTTP, bounded waits."""

from __future__ import annotations

import time

import httpx
import pytest
from test_serve_lifecycle import _sample
from test_serve_security import BASE, Raw
from test_tinker_wire import Server
from tinker import types


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("stats_state"))
    yield s
    s.stop()


def _stats(server: Server, key: str) -> dict:
    return httpx.get(server.url + "/stats", headers={"X-API-Key": key}, timeout=30).json()


def test_stats_count_each_keys_work_in_flight_apart(server):
    busy, other = Raw(server.url, "tml-stats-busy"), Raw(server.url, "tml-stats-other")
    sampler = busy.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=busy.session, sampling_session_seq_id=0, base_model=BASE))["sampling_session_id"]
    try:
        for seq in range(2):  # long enough to be in flight when /stats is read
            _sample(busy, sampler, seq, max_tokens=500, n=64)
        mine, theirs = _stats(server, "tml-stats-busy"), _stats(server, "tml-stats-other")
        assert mine["key"]["inflight"] == 2, mine
        assert theirs["key"]["inflight"] == 0 and theirs["inflight"] >= 2, theirs
    finally:  # the session's end cancels both, so the server stops at once after a failure too
        busy.ok(f"sessions/{busy.session}/finish", {"reason": {"type": "success"}})
        other.ok(f"sessions/{other.session}/finish", {"reason": {"type": "success"}})
    t = time.monotonic()
    while _stats(server, "tml-stats-busy")["key"]["inflight"] and time.monotonic() - t < 15:
        time.sleep(0.2)
    assert _stats(server, "tml-stats-busy")["key"]["inflight"] == 0
