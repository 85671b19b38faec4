"""What connections may hold of `python -m trainer.serve` (`trainer/serve/connections.py`): a body trickled a
byte at a time is cut off by `--read-timeout-s`, open connections and one key's requests in progress are
capped while health checks keep answering, and a flood of bad requests logs a bounded number of lines.

A real server subprocess on 127.0.0.1, driven with raw sockets (what a slow or hostile client sends);
every loop is bounded in count and time, and at most ~50 sockets are open at once.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_tinker_wire import ENGINE, ROOT

READ_TIMEOUT_S = 3
CONNECTIONS = 24
PER_KEY = 6


class _Server:
    """The server with its stderr in a file (read while it runs: a pipe nobody reads would block it)."""

    def __init__(self, tmp: Path, *extra: str):
        self.log = tmp / "serve.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.err = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.serve", "--state-dir", str(tmp / "state"), *ENGINE, *extra],
            stdout=subprocess.PIPE, stderr=self.err, text=True, env=env)
        line = self.proc.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:"), (line, self.log.read_text()[-2000:])
        self.url = line.split()[-1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def health_s(self, key: str = "tml-health") -> float:
        t = time.monotonic()
        r = httpx.get(self.url + "/api/v1/healthz", headers={"X-API-Key": key}, timeout=10)
        assert r.status_code == 200, r.text
        return time.monotonic() - t

    def stats(self) -> dict:
        return httpx.get(self.url + "/stats", headers={"X-API-Key": "tml-health"}, timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=30)
        self.err.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = _Server(tmp_path_factory.mktemp("connections"), "--read-timeout-s", str(READ_TIMEOUT_S),
                "--max-connections", str(CONNECTIONS), "--max-connections-per-key", str(PER_KEY))
    yield s
    s.stop()


def _trickler(port: int, key: str) -> socket.socket:
    """A connection that sent its headers and the first byte of a 1000-byte body."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(f"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\n"
              "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the server answered and closed (or reset) this connection (non-blocking)."""
    readable, _, _ = select.select([s], [], [], 0)
    if not readable:
        return False
    try:
        while s.recv(65536):
            if not select.select([s], [], [], 0.2)[0]:
                return False
    except OSError:
        return True
    return True


def _trickle_until_closed(socks: list[socket.socket], limit_s: float, every_s: float = 0.5) -> float:
    """Send one more body byte on each open connection every `every_s` (well inside the silence the old
    timeout allowed) until the server has closed them all; the seconds that took (inf past `limit_s`)."""
    t0 = time.monotonic()
    open_ = list(socks)
    while open_ and time.monotonic() - t0 < limit_s:
        for s in list(open_):
            if _closed(s):
                open_.remove(s)
                continue
            with contextlib.suppress(OSError):
                s.sendall(b" ")
        time.sleep(every_s)
    return time.monotonic() - t0 if not open_ else float("inf")


def test_a_trickled_body_is_cut_off_by_the_read_timeout(server):
    """12 bodies trickled at a byte per 0.5 s (never silent for --read-timeout-s 3) are answered and
    closed within a few seconds of the timeout, not when their 1000 bytes finally arrive (500 s)."""
    socks = [_trickler(server.port, f"tml-trickle{i % 3}") for i in range(12)]
    try:
        took = _trickle_until_closed(socks, limit_s=READ_TIMEOUT_S + 12)
    finally:
        for s in socks:
            s.close()
    assert took < READ_TIMEOUT_S + 12, "trickled bodies were still open"
    assert server.health_s() < 2


def test_one_keys_requests_in_progress_are_capped(server):
    """A key holding --max-connections-per-key (6) requests in progress gets 429 naming the flag for the
    next one, at once; another key is answered meanwhile."""
    socks = [_trickler(server.port, "tml-hog") for _ in range(PER_KEY)]
    try:
        time.sleep(0.5)  # the server has taken all six
        t = time.monotonic()
        r = httpx.get(server.url + "/api/v1/healthz", headers={"X-API-Key": "tml-hog"}, timeout=10)
        assert r.status_code == 429 and "--max-connections-per-key" in r.json()["detail"], r.text
        assert time.monotonic() - t < 2
        assert server.health_s("tml-other") < 2
    finally:
        for s in socks:
            s.close()


def test_idle_connections_past_the_cap_do_not_keep_a_new_client_out(server):
    """40 connections that never send a byte, against --max-connections 24: the oldest idle ones are
    closed to make room, at most 24 stay open, and health checks on new connections answer at once."""
    socks = []
    try:
        for _ in range(40):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        times = [server.health_s() for _ in range(5)]
        assert max(times) < 2, times
        time.sleep(0.3)
        still_open = sum(1 for s in socks if not _closed(s))
        assert still_open <= CONNECTIONS, still_open
        assert server.stats()["connections"]["open"] <= CONNECTIONS
    finally:
        for s in socks:
            s.close()


def test_past_the_cap_of_busy_connections_a_new_one_is_closed_at_once(server):
    """With --max-connections (24) requests in progress (trickled bodies of several keys), a new
    connection is closed at once instead of queueing behind them; once their bodies time out the server
    answers again."""
    socks = [_trickler(server.port, f"tml-busy{i % 4}") for i in range(CONNECTIONS)]
    try:
        time.sleep(0.5)
        t = time.monotonic()
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/api/v1/healthz", headers={"X-API-Key": "tml-late"}, timeout=5)
        assert time.monotonic() - t < 2
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if server.health_s() < 2:
                break
        time.sleep(0.2)
    else:
        raise AssertionError("the server did not answer after the busy connections closed")


def test_a_flood_of_bad_requests_logs_a_bounded_number_of_lines(server):
    """30 requests aiohttp cannot parse (headers over 8 KB) each log an error with a traceback; one line of
    that kind (and its traceback) reaches the log per interval, not 30."""
    before = server.log.read_text().count("Error handling request")
    for _ in range(30):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000 + b"\r\n\r\n")
            s.settimeout(5)
            with contextlib.suppress(OSError):
                while s.recv(65536):
                    pass
    time.sleep(0.5)
    text = server.log.read_text()
    assert text.count("Error handling request") - before <= 1, text[-3000:]
    assert text.count("Traceback") <= 2
    assert server.health_s() < 2


def test_repeated_log_lines_are_counted_not_repeated():
    """One line per kind per interval; the rest counted, in the next line of that kind or by `flush`."""
    import io
    import logging

    from trainer.serve.connections import RateLimitedLog

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    limiter = RateLimitedLog(interval_s=0.2)
    handler.addFilter(limiter)
    log = logging.getLogger("test.rate_limited")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        for i in range(50):
            log.error("accept failed on fd %d", i)
        log.warning("another kind")
        log.info("below warning: never held back")
        log.info("below warning: never held back")
        assert out.getvalue().count("accept failed") == 1 and "another kind" in out.getvalue()
        time.sleep(0.25)
        limiter.flush(log)
        assert "49 more log lines like 'accept failed on fd %d'" in out.getvalue(), out.getvalue()
        log.error("accept failed on fd %d", 99)  # a new interval: it passes again
        assert out.getvalue().count("accept failed on fd") == 2
        assert out.getvalue().count("below warning") == 2
    finally:
        log.removeHandler(handler)
