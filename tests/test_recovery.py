"""Recovery from a lost rank, MPI-free: the lost rank read back from the
lines that name it, where the next job runs, the supervised job's command
line and its ready file (ggpipe/cluster/recovery.py, ggpipe/frontends/supervisor.py)."""

from __future__ import annotations

import json
import signal
import socket
import time

import psutil
import pytest

from ggpipe.cluster.recovery import READY_ENV, RecoveryPolicy, parse_loss, read_ready, write_ready
from ggpipe.frontends.supervisor import job_argv, launch_command, write_hostfile
from ggpipe.transport.liveness import HeartbeatMonitor, Liveness
from ggpipe.transport.rank_guard import death_line


def test_the_guards_line_names_the_lost_rank():
    line = death_line(2, "node3", 4242, signal.SIGKILL, "target layers 27-39", "decoding run 57 (4 tokens)")
    loss = parse_loss(line)
    assert (loss.rank, loss.host, loss.pid, loss.how) == (2, "node3", 4242, "died")
    head = parse_loss(death_line(0, "node1", 17, signal.SIGKILL, "", ""))
    assert (head.rank, head.host) == (0, "node1")


def _heartbeat_line(rank: int, peer: int) -> str:
    """The line of ``rank``'s heartbeats reporting ``peer`` (a process on
    another host), as Liveness.message writes it."""
    lv = Liveness.__new__(Liveness)
    lv.rank, lv.timeout_s = rank, 6.0
    lv.monitor = HeartbeatMonitor([peer], 6.0, 0.0)
    lv.peer_info = lambda r: ("elsewhere", 99)
    lv.describe = lambda r: f"{'the head, rank 0' if r == 0 else f'rank {r}'} (node{r}, pid 5{r}, target layers 1-2)"
    lv.activity = lambda: "generating"
    return "ggpipe: error: " + lv.message(peer, 6.3)


@pytest.mark.parametrize("rank,peer", [(0, 2), (1, 0)])
def test_the_heartbeats_line_names_the_lost_rank(rank, peer):
    loss = parse_loss(_heartbeat_line(rank, peer))
    assert (loss.rank, loss.host, loss.pid, loss.how) == (peer, f"node{peer}", int(f"5{peer}"), "stopped answering")


@pytest.mark.parametrize("line", [
    "ggpipe: error: rank 0 (vm) waited 60 s for the logits of run 12 from rank 1 (node2): it stopped answering",
    "ggpipe: error: prompt too long",
    "batch:  50%|#####     | 8/16 [00:02<00:02,  3.90req/s]",
    "rank 1 (vm, pid 12) died",   # not ggpipe's line
])
def test_other_lines_name_no_lost_rank(line):
    assert parse_loss(line) is None


def test_a_lost_rank_runs_again_on_the_same_hosts():
    p = RecoveryPolicy(3, None)
    loss = parse_loss(death_line(1, socket.gethostname(), 5, signal.SIGKILL, "", ""))
    for _ in range(10):   # progress between losses: never left out
        assert p.lost(loss, progressed=True) is None
    assert p.n_ranks == 3 and p.hosts is None and p.excluded == []


def test_a_host_that_keeps_losing_ranks_without_progress_is_left_out_and_a_spare_takes_its_place():
    p = RecoveryPolicy(3, [("a", 1), ("b", 1), ("c", 1), ("d", 1)])
    assert p.placed() == ["a", "b", "c"]
    loss = parse_loss(death_line(1, "b", 5, signal.SIGKILL, "", ""))
    assert p.lost(loss, progressed=False) is None
    assert p.lost(None, progressed=False) is None   # the next job did not start: the same host blamed
    assert p.excluded == []
    assert p.lost(loss, progressed=False) is None
    assert p.excluded == ["b"] and p.placed() == ["a", "c", "d"] and p.n_ranks == 3


def test_without_a_spare_the_job_goes_on_with_one_stage_fewer():
    p = RecoveryPolicy(3, [("a", 1), ("b", 1), ("c", 1)])
    loss = parse_loss(death_line(2, "c", 5, signal.SIGKILL, "", ""))
    assert [p.lost(loss, progressed=False) for _ in range(3)] == [None, None, None]
    assert p.placed() == ["a", "b"] and p.n_ranks == 2


def test_progress_forgives_earlier_losses():
    p = RecoveryPolicy(2, [("a", 1), ("b", 1)])
    loss = parse_loss(death_line(1, "b", 5, signal.SIGKILL, "", ""))
    p.lost(loss, progressed=False)
    p.lost(loss, progressed=False)
    p.lost(loss, progressed=True)
    assert p.lost(loss, progressed=False) is None and p.excluded == []


@pytest.mark.parametrize("hosts,rank,words", [
    (None, 1, "no other host"),
    ([("a", 2), ("b", 1)], 0, "head's host"),
    ([("a", 4)], 1, "no other host"),
])
def test_nowhere_left_to_run_is_one_reason(hosts, rank, words):
    p = RecoveryPolicy(2, hosts)
    loss = parse_loss(death_line(rank, socket.gethostname(), 5, signal.SIGKILL, "", ""))
    reasons = [p.lost(loss, progressed=False) for _ in range(3)]
    assert reasons[:2] == [None, None] and words in reasons[2] and "3 jobs in a row" in reasons[2]


def test_nothing_to_recover_from_is_refused():
    with pytest.raises(ValueError):
        RecoveryPolicy(2, None).lost(None, progressed=False)


def test_the_job_runs_the_same_command_without_the_supervisors_options():
    argv = ["batch", "in.jsonl", "--ranks", "3", "-o", "out.jsonl", "--hostfile=h", "-n", "8", "--parallel", "4"]
    assert job_argv(argv) == ["batch", "in.jsonl", "-o", "out.jsonl", "-n", "8", "--parallel", "4"]
    assert job_argv(["batch", "--ranks=2", "x"]) == ["batch", "x"]


def test_launch_commands(tmp_path):
    assert launch_command("mpich", 3, None) == ["mpiexec", "-n", "3"]
    assert launch_command("mpich", 2, "h") == ["mpiexec", "-n", "2", "-f", "h", "-ppn", "1"]
    assert launch_command("openmpi", 2, "h") == ["mpiexec", "-n", "2", "--hostfile", "h", "--map-by", "node",
                                                 "-x", READY_ENV]
    assert launch_command("openmpi", 2, None, ("K",)) == ["mpiexec", "-n", "2", "-x", READY_ENV, "-x", "K"]
    assert launch_command("mpich", 2, None, ("K",)) == ["mpiexec", "-n", "2"]   # Hydra passes the environment
    write_hostfile(tmp_path / "m", [("a", 1), ("b", 2)], "mpich")
    write_hostfile(tmp_path / "o", [("a", 1), ("b", 2)], "openmpi")
    assert (tmp_path / "m").read_text() == "a:1\nb:2\n"
    assert (tmp_path / "o").read_text() == "a slots=1\nb slots=2\n"


def test_the_ready_file(tmp_path, monkeypatch):
    path = tmp_path / "ready.json"
    monkeypatch.delenv(READY_ENV, raising=False)
    write_ready(["rank 0 (vm): target layers 0-14"])
    assert read_ready(path) is None and not path.exists()
    monkeypatch.setenv(READY_ENV, str(path))
    write_ready(["rank 0 (vm): target layers 0-14"])
    assert read_ready(path) == ["rank 0 (vm): target layers 0-14"]
    path.write_text(json.dumps({"other": 1}))
    assert read_ready(path) is None


# -- the serve front end's streams (ggpipe/frontends/serve/front.py) ----------------------------------------------

def _chunk(text=None, reason=None, role=False, rid="a", kind="chat") -> str:
    if kind == "chat":
        delta = {} if text is None else ({"role": "assistant", "content": text} if role else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": reason}
    return "data: " + json.dumps({"id": rid, "created": 1 if rid == "a" else 2, "choices": [choice]})


def _texts(out: list[str]) -> list:
    got = []
    for ev in out:
        for line in ev.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                if "error" in obj:
                    got.append(("error", obj["error"]["code"]))
                else:
                    c = obj["choices"][0]
                    got.append((obj["id"], obj["created"], (c.get("delta") or {}).get("content", c.get("text")),
                                c["finish_reason"]))
    return got


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_resent_stream_goes_on_after_the_tokens_sent(kind):
    from ggpipe.frontends.serve.front import _FAILED, Backend, _Resend, _send_again

    def tokens(chunk: str, ids: list[int]) -> str:
        obj = json.loads(chunk[6:])
        obj["ggpipe_tokens"] = ids
        return "data: " + json.dumps(obj)

    r = _Resend(lambda error: _send_again(error, Backend()))
    first = [_chunk("", role=True, kind=kind), tokens(_chunk("Hel", kind=kind), [1, 2]),
             tokens(_chunk("lo", kind=kind), [3])]
    out = [r.event(x) for x in first]
    assert r.event('data: {"error": {"code": "pipeline_failed", "message": "x"}}') is _FAILED
    assert json.loads(r.body(b'{"prompt": "x", "stream": true}')) == {
        "prompt": "x", "stream": True, "ggpipe_resume": {"tokens": [1, 2, 3], "sent": 5}}
    opening = [_chunk("", role=True, rid="b", kind=kind)] if kind == "chat" else []   # a text stream has none
    second = [*opening, tokens(_chunk(" wor", rid="b", kind=kind), [4]),
              _chunk("ld", rid="b", kind=kind), _chunk(None, "stop", rid="b", kind=kind), "", "data: [DONE]"]
    out += [r.event(x) for x in second]
    sent = [e for e in out if e]
    texts = _texts(sent)
    assert [t[2] for t in texts] == ["", "Hel", "lo", " wor", "ld", None if kind == "chat" else ""]
    assert {(t[0], t[1]) for t in texts} == {("a", 1)}   # the first job's id and time throughout
    assert texts[-1][3] == "stop" and sent[-1] == "data: [DONE]\n\n" and r.done
    assert "ggpipe_tokens" not in "".join(sent) and r.tokens == [1, 2, 3, 4]


class _Vocab:
    """A vocabulary of one character per token id (``chr(id)``); 0 ends the generation."""

    def is_eog(self, t: int) -> bool:
        return t == 0

    def detokenizer(self):
        class D:
            def push(self, t):
                return chr(t)

            def flush(self):
                return ""
        return D()


def test_a_text_stream_goes_on_after_what_another_job_sent():
    from ggpipe.service.text import TextStream

    got, ids = [], []
    s = TextStream(_Vocab(), got.append, stop=["xyz"], on_tokens=ids.append)
    s.resume([ord(c) for c in "Hello"], 3)       # "Hel" was sent, "lo" held back
    assert got == [] and s.text == "Hello"
    assert not s.emit([ord("!")])
    # from where the other job stopped (two characters held back for "xyz"); only the new tokens
    assert got == ["l"] and ids == [[ord("!")]]
    assert s.finish(s.tokens, 99) == "stop" and "".join(got) == "lo!"
    with pytest.raises(ValueError, match="5 characters were sent, but the 2 tokens given hold 2"):
        TextStream(_Vocab()).resume([ord("a"), ord("b")], 5)


def test_the_backend_waits_for_a_newer_job_and_counts_the_time_without_service():
    import asyncio

    from ggpipe.frontends.serve.front import Backend, Unavailable

    b = Backend()
    b.up(1000)
    assert asyncio.run(b.serving()) == (1000, 1) and not b.recovering
    b.down()
    assert b.recovering

    async def later():
        await asyncio.sleep(0.1)
        b.up(1001)

    async def wait():
        t = asyncio.create_task(later())
        got = await b.serving(1)
        await t
        return got

    assert asyncio.run(wait()) == (1001, 2)
    assert b.recoveries._value.get() == 1 and b.down_seconds._value.get() >= 0.1
    b.fail("no host is left")
    with pytest.raises(Unavailable, match="no host is left"):
        asyncio.run(b.serving())


def test_requests_sent_again_from_their_prompts_wait_behind_the_streams_cut_in_the_middle(monkeypatch):
    import asyncio

    from ggpipe.frontends.serve import front
    from ggpipe.frontends.serve.front import Backend

    b = Backend()
    b.up(1000)
    b.down()
    order: list[str] = []

    async def cut():
        with b.first_in_line():
            await b.serving(1, poll_s=0.01)
            await asyncio.sleep(0.2)     # sent to the new job
            order.append("cut")

    async def behind():
        await b.serving(1, poll_s=0.01, behind=True)
        order.append("behind")

    async def run():
        tasks = [asyncio.create_task(behind()), asyncio.create_task(cut())]
        await asyncio.sleep(0.05)
        b.up(1001)
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert order == ["cut", "behind"]
    # a stream that never gets there holds the others up for BEHIND_MAX_S at most
    monkeypatch.setattr(front, "BEHIND_MAX_S", 0.1)
    b.down()
    b.up(1002)

    async def stuck():
        with b.first_in_line():
            await asyncio.sleep(10)

    async def run2():
        t = asyncio.create_task(stuck())
        await asyncio.sleep(0.01)
        start = asyncio.get_running_loop().time()
        await b.serving(2, poll_s=0.01, behind=True)
        t.cancel()
        return asyncio.get_running_loop().time() - start

    assert 0.1 <= asyncio.run(run2()) < 2


# -- the front end's app against a stand-in for the job's server ------------------------------------------------

class _StandIn:
    """A job's server on a loopback port (uvicorn on a thread) that answers
    completions as ``replies`` says, one reply per request, in turn: "fail"
    (503 pipeline_failed), "down" (503 ``shutdown``: the job dropped it as it
    stopped; streamed: that error event), a list of texts streamed then a
    pipeline failure, or "ok:TEXT" (the whole text, streamed or not). Streamed chunks carry
    their token ids (one per character: its code point); a request with
    ``ggpipe_resume`` gets the reply's text after the characters sent
    (``resumes`` keeps what it was given, ``keys`` the front end's key)."""

    def __init__(self, replies: list):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.replies, self.calls, self.resumes, self.keys = list(replies), 0, [], []

        def sse(obj) -> str:
            return "data: " + json.dumps(obj) + "\n\n"

        def chunk(text, reason=None) -> dict:
            return {"id": f"cmpl-{self.calls}", "created": self.calls, "ggpipe_tokens": [ord(c) for c in text],
                    "choices": [{"index": 0, "text": text, "finish_reason": reason}]}

        failed = {"error": {"message": "the pipeline failed", "type": "server_error", "code": "pipeline_failed"}}
        down = {"error": {"message": "the server is shutting down", "type": "server_error", "code": "shutdown"}}

        async def completions(request):
            body = await request.json()
            self.calls += 1
            self.keys.append(request.headers.get("x-ggpipe-front"))
            resume = body.get("ggpipe_resume")
            self.resumes.append(resume)
            skip = resume["sent"] if resume else 0
            reply = self.replies.pop(0)
            if reply == "fail":
                return JSONResponse(failed, status_code=503)
            if reply == "down" and not body.get("stream"):
                return JSONResponse(down, status_code=503)
            if not body.get("stream"):
                return JSONResponse({"id": "x", "choices": [{"index": 0, "text": reply[3:], "finish_reason": "stop"}]})

            async def events():
                if reply == "down":
                    yield sse(down) + "data: [DONE]\n\n"
                    return
                if isinstance(reply, list):
                    rest = "".join(reply)[skip:]
                    if rest:
                        yield sse(chunk(rest))
                    yield sse(failed) + "data: [DONE]\n\n"
                    return
                text = reply[3 + skip:]
                for i in range(0, len(text), 2):
                    yield sse(chunk(text[i:i + 2]))
                yield sse(chunk("", "stop")) + "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/completions", completions,
                                                                            methods=["POST"])]),
                                                    log_level="warning", lifespan="off"))
        import threading

        threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True


def _front(replies: list):
    """(TestClient of the front end's app, its Backend, the stand-in); the
    stand-in "restarts" (a new epoch) every 50 ms."""
    import threading

    from starlette.testclient import TestClient

    from ggpipe.frontends.serve.front import Backend, FrontEnd, create_front_app

    stand_in = _StandIn(replies)
    backend = Backend()
    backend.up(stand_in.port)
    stop = threading.Event()

    def restarts():
        while not stop.wait(0.05):
            backend.up(stand_in.port)

    threading.Thread(target=restarts, daemon=True).start()
    app = create_front_app(backend, FrontEnd(backend, "http://x/v1"), 1 << 20, 64, "k3y")
    return TestClient(app), backend, stand_in, stop


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_job_failed_is_answered_by_the_next_job(stream):
    client, backend, stand_in, stop = _front(["fail", "ok:Hello world"])
    try:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 200
        if stream:
            texts = [json.loads(x[6:])["choices"][0]["text"] for x in r.text.split("\n\n")
                     if x.startswith("data: {")]
            assert "".join(texts) == "Hello world"
        else:
            assert r.json()["choices"][0]["text"] == "Hello world"
        assert stand_in.calls == 2 and backend.resent._value.get() == 1
    finally:
        stop.set()
        stand_in.close()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stopping", [False, True])
def test_a_request_the_job_dropped_as_it_stopped_goes_to_the_next_job_unless_the_command_stops(stream, stopping):
    """The launcher ends the whole job when a rank is lost, and the head may
    answer its queued requests "the server is shutting down" before it
    goes: the next job answers them; when the command itself was asked to
    stop, that answer is the client's."""
    client, backend, stand_in, stop = _front(["down", "ok:Hello world"])
    backend.stopping = stopping
    try:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        if stopping:
            assert stand_in.calls == 1 and "the server is shutting down" in r.text
            assert r.status_code == (200 if stream else 503)
        else:
            assert stand_in.calls == 2 and r.status_code == 200 and "shutting down" not in r.text
            text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in r.text.split("\n\n")
                           if x.startswith("data: {")) if stream else r.json()["choices"][0]["text"]
            assert text == "Hello world"
    finally:
        stop.set()
        stand_in.close()


def test_a_stream_cut_by_a_lost_rank_goes_on_in_the_next_job_without_repeating_itself():
    client, backend, stand_in, stop = _front([["Hel", "lo"], "ok:Hello world"])
    try:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == "Hello world"
        assert {e["id"] for e in events} == {"cmpl-1"} and r.text.endswith("data: [DONE]\n\n")
        assert events[-1]["choices"][0]["finish_reason"] == "stop" and "ggpipe_tokens" not in r.text
        assert stand_in.resumes == [None, {"tokens": [ord(c) for c in "Hello"], "sent": 5}]
        assert stand_in.keys == ["k3y", "k3y"]
    finally:
        stop.set()
        stand_in.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_running_each_time_a_rank_is_lost_gets_503_after_three_tries(stream):
    from ggpipe.frontends.serve.front import RESENDS

    client, backend, stand_in, stop = _front(["fail"] * (RESENDS + 1) if not stream else
                                             [["a"]] * (RESENDS + 1))
    try:
        r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        if stream:
            assert r.status_code == 200 and "lost a rank 3 times" in r.text and r.text.endswith("data: [DONE]\n\n")
            assert r.text.count('"text": "a"') == 1   # the text sent once, not once per try
        else:
            assert r.status_code == 503 and "lost a rank 3 times" in r.json()["error"]["message"]
        assert stand_in.calls == RESENDS + 1
    finally:
        stop.set()
        stand_in.close()


def test_health_says_recovering_and_metrics_count():
    from starlette.testclient import TestClient

    from ggpipe.frontends.serve.front import Backend, FrontEnd, create_front_app

    backend = Backend()
    client = TestClient(create_front_app(backend, FrontEnd(backend, "http://x/v1"), 1 << 20, 64, "k3y"))
    assert client.get("/health").json() == {"status": "loading"}
    backend.up(1)
    backend.down()
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "recovering"}
    backend.fail("host vm lost a rank in 3 jobs in a row")
    assert client.get("/health").json()["status"] == "failed"
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "host vm lost a rank" in r.json()["error"]["message"]


def test_the_lost_host_is_the_hostfile_entry_the_rank_was_placed_on():
    """A hostfile of addresses: the rank's line names its host name, the
    policy leaves out the address it was placed on."""
    p = RecoveryPolicy(3, [("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1), ("10.0.0.4", 1)])
    loss = parse_loss(death_line(1, "node2", 5, signal.SIGKILL, "", ""))
    for _ in range(3):
        p.lost(loss, progressed=False)
    assert p.excluded == ["10.0.0.2"] and p.placed() == ["10.0.0.1", "10.0.0.3", "10.0.0.4"]


def _stand_in_launcher(tmp_path, then: str, later: str):
    """A stand-in ``mpiexec`` (hydra, by its ``--version``): its first job
    names rank 1 (host vm) lost by the guard's line, then runs the shell
    command ``then``; every later job runs ``later``. Returns (its path, the
    file with one line per job)."""
    calls, fake = tmp_path / "calls", tmp_path / "mpiexec"
    line = death_line(1, "vm", 5, signal.SIGKILL, "", "")
    fake.write_text(f"""#!/bin/sh
[ "$1" = --version ] && {{ echo "HYDRA build details"; exit 0; }}
echo x >> {calls}
if [ "$(wc -l < {calls})" = 1 ]; then echo "{line}" >&2; {then}; fi
{later}
""")
    fake.chmod(0o755)
    return fake, calls


def test_a_job_started_again_that_never_gets_ready_is_ended_and_counts_against_its_host(tmp_path, capfd):
    """A stand-in launcher: its first job loses rank 1 before it is ready,
    every later one hangs at start-up. The supervisor ends each hung start
    after its time-out, blames the lost rank's host, and after 3 jobs in a
    row without progress stops in one line: that host is the only one."""
    from ggpipe.frontends.supervisor import Supervisor

    fake, calls = _stand_in_launcher(tmp_path, "exit 9", "exec sleep 60")

    class Quick(Supervisor):
        MIN_RESTART_S = 0.5

    sup = Quick(["batch"], RecoveryPolicy(3, None), mpiexec=str(fake), poll_s=0.05)
    t0 = time.monotonic()
    code = sup.run()
    err = capfd.readouterr().err
    assert code == 128 + signal.SIGTERM and time.monotonic() - t0 < 30   # the last, hung start was ended
    assert calls.read_text().count("x") == 3
    assert err.count("is not ready after") == 2 and "(the first loaded in" not in err
    assert "the job could not start again on vm" in err and "there is no other host to run on: the job stops" in err


def test_a_launcher_that_does_not_end_after_the_loss_is_ended_and_the_job_starts_again(tmp_path, capfd):
    """A stand-in launcher whose first job names a lost rank and then hangs
    (Open MPI's waits for its daemon on a host it can no longer reach; Hydra
    across hosts, for the head's heartbeats): the supervisor ends it after
    LINGER_S, with the process it started in a session of its own (as
    Hydra's proxy and the ranks' guards are), and starts the job again,
    which ends normally."""
    from ggpipe.frontends.supervisor import Supervisor

    child = tmp_path / "child"
    fake, calls = _stand_in_launcher(tmp_path, f"setsid sleep 60 & echo $! > {child}; exec sleep 60", "exit 0")

    class Quick(Supervisor):
        LINGER_S = 0.5

    t0 = time.monotonic()
    assert Quick(["batch"], RecoveryPolicy(3, None), mpiexec=str(fake), poll_s=0.05).run() == 0
    err = capfd.readouterr().err
    assert time.monotonic() - t0 < 30 and calls.read_text().count("x") == 2
    assert "the launcher has not ended 0.5 s after the loss; ending it" in err
    assert "starting the job again on 3 ranks" in err
    pid, deadline = int(child.read_text()), time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:   # killed, not yet reaped
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the process the launcher started in a session of its own is still running")
