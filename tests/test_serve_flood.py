"""``ggpipe serve`` under a connection flood: the connection cap, the read
time limit and the one-line-a-second log (ggpipe.frontends.serve.http_limits,
ggpipe.frontends.serve.http_protocol). A fake engine, loopback only; every test
ends by itself within seconds."""

from __future__ import annotations

import errno
import http.client
import json
import re
import select
import socket
import threading
import time

import pytest

from ggpipe.frontends.serve.http_limits import ConnectionLimits, RefusalLog, default_max_connections
from ggpipe.sampling_params import SamplingParams
from tests.test_serve_trust import SlowEngine, _raw_post, _until

UNFINISHED = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"   # no blank line: the headers never end


@pytest.fixture()
def capped_server():
    """A server on a fake engine with at most 50 connections and a 1.5 s read limit."""
    from ggpipe.frontends.serve.server import Server

    engine = SlowEngine(step_s=0.01)
    engine.n_ctx = 4096
    server = Server(engine, "127.0.0.1", 0, None, 4, SamplingParams(),
                    limits=ConnectionLimits(50, read_timeout_s=1.5))
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    _until(lambda: server.http is not None and server.http.started, what="the server to start")
    yield server
    server.state.stopping.set()
    t.join(30)


def _get(port: int, method: str = "GET", path: str = "/health", body: dict | None = None) -> tuple[int, float]:
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        data = json.dumps(body).encode() if body is not None else None
        c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = c.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        c.close()


def _closed_by_peer(s: socket.socket) -> bool:
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        return False
    try:
        return s.recv(4096) == b""
    except (ConnectionResetError, BlockingIOError):
        return True


def test_a_flood_of_unfinished_requests_leaves_the_server_answering(capped_server, capfd):
    server = capped_server
    flood = []
    try:
        for _ in range(200):            # 4x the cap, each with headers that never end
            s = socket.create_connection(("127.0.0.1", server.port), timeout=2.0)
            s.sendall(UNFINISHED)
            flood.append(s)
        t_flooded = time.monotonic()
        for _ in range(3):              # meanwhile: /health and a completion, each within 2 s
            status, took = _get(server.port)
            assert status == 200 and took < 2.0, (status, took)
            status, took = _get(server.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3})
            assert status == 200 and took < 2.0, (status, took)
            assert len(server.http.server_state.connections) <= 51
        # every unfinished connection is closed by the server within the read limit (1.5 s)
        _until(lambda: all(_closed_by_peer(s) for s in flood), timeout_s=1.5 + 1.0,
               what="the unfinished connections to be closed")
        assert time.monotonic() - t_flooded < 1.5 + 1.0
        status, _ = _get(server.port)
        assert status == 200
    finally:
        for s in flood:
            s.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) <= 10, err
    assert "unfinished connections closed for newer ones" in err, err


def test_a_request_that_dribbles_in_is_closed_at_the_read_limit(capped_server):
    """A byte every 0.2 s does not push the limit back (uvicorn's keep-alive timer would be)."""
    s = socket.create_connection(("127.0.0.1", capped_server.port), timeout=2.0)
    t0 = time.monotonic()
    try:
        for b in UNFINISHED * 10:
            try:
                s.send(bytes([b]))
            except OSError:
                break
            if _closed_by_peer(s):
                break
            time.sleep(0.2)
        took = time.monotonic() - t0
        assert 1.4 < took < 2.5, took
    finally:
        s.close()


def test_a_body_that_never_ends_is_closed_at_the_read_limit(capped_server, capfd):
    s = _raw_post(capped_server.port, {"prompt": "x", "max_tokens": 3}, partial=100)
    try:
        t0 = time.monotonic()
        _until(lambda: _closed_by_peer(s), timeout_s=3.0, what="the connection to be closed")
        assert 1.4 < time.monotonic() - t0 < 2.5
    finally:
        s.close()
    time.sleep(0.2)
    assert "Traceback" not in capfd.readouterr().err


def test_beyond_the_cap_with_every_connection_busy_the_new_one_gets_503():
    from ggpipe.frontends.serve.server import Server

    engine = SlowEngine(step_s=0.02)
    engine.n_ctx = 4096
    server = Server(engine, "127.0.0.1", 0, None, 4, SamplingParams(), limits=ConnectionLimits(3, 5.0))
    t = threading.Thread(target=server.serve, daemon=True)
    t.start()
    _until(lambda: server.http is not None and server.http.started, what="the server to start")
    busy = []
    try:
        busy = [_raw_post(server.port, {"prompt": "x", "max_tokens": 100}) for _ in range(3)]   # 2 s each
        _until(lambda: engine.generated and server.state.jobs.qsize() == 2, what="1 running and 2 queued")
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=2.0)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 503 and r.getheader("Retry-After") == "1"
        assert json.loads(r.read())["error"]["code"] == "busy"
        c.close()
    finally:
        for s in busy:
            s.close()
        server.state.stopping.set()
        t.join(30)


def test_refusals_make_one_line_a_second():
    lines, now = [], [0.0]
    log = RefusalLog(50, 10.0, write=lines.append, clock=lambda: now[0])
    for i in range(10_000):             # 10,000 refusals over 2.5 s
        now[0] = i * 2.5e-4
        log.note("evicted")
    log.flush()
    assert len(lines) <= 4, lines
    assert sum(int(re.search(r"(\d+) unfinished connections", ln).group(1)) for ln in lines) == 10_000


def test_failed_accepts_are_counted_not_logged_each(capfd):
    """asyncio hands every accept that failed for lack of file descriptors to
    the loop's exception handler with a traceback; the server counts them."""
    import asyncio

    import uvicorn

    from ggpipe.frontends.serve.http_protocol import GuardedServer

    limits = ConnectionLimits(50, 10.0)
    server = GuardedServer(uvicorn.Config(lambda *a: None), limits)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(5000):
            server._loop_error(loop, {"message": "socket.accept() out of system resource",
                                      "exception": OSError(errno.EMFILE, "Too many open files")})
        limits.log.flush()
    finally:
        loop.close()
    err = capfd.readouterr().err
    assert len(err.splitlines()) <= 2 and "Traceback" not in err, err
    assert "Too many open files" in err


def test_the_default_cap_leaves_the_head_its_descriptors():
    assert default_max_connections(1024) == 768
    assert default_max_connections(20_000) == 20_000 - 2_500
    assert default_max_connections(100) == 50
    assert default_max_connections(10) == 16
