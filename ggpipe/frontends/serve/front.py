"""The front end of ``ggpipe serve --ranks N`` (run without ``mpiexec``): the
HTTP server that outlives the MPI job that computes.

The command listens on ``--host``/``--port`` itself and starts the job
(:class:`ggpipe.frontends.supervisor.Supervisor`), which serves on a
loopback port of its own; every request is passed on to it and its answer
passed back as it comes. When the job loses a rank, the requests in flight
wait (``/health`` says ``recovering``) until the supervisor has started the
job again, and are then sent to the new job, as Petals replays a
client's inputs to a new server (so are those the old job answered as it
stopped, "the server is shutting down", unless this command is stopping):

* a non-streaming request is sent again from its prompt, and simply
  answered later;
* a streaming request goes on where it stopped: the front end keeps the
  token ids of the text sent so far (the job's chunks carry them for it,
  ggpipe.frontends.serve.resume), and the new job prefills the prompt and
  those tokens and generates the rest; the client sees a pause in its
  stream. The tokens after the pause are those of an uninterrupted run
  where the build's batch rows equal its lone-token rows (the exact build;
  the kernels report says how far they may differ,
  docs/user-guide/exactness.md).

A request is sent again at most :data:`RESENDS` times (a request that brings
the job down each time must not keep the server down). What the job's server
checks (API key, Host and Origin, bodies, every field) it still checks;
this front end adds only the connection limits of its own listening socket
(:mod:`ggpipe.frontends.serve.http_limits`), the body size limit, and three
counters on ``/metrics``: recoveries, requests sent again and the seconds
without service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import sys
import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ggpipe.cluster.recovery import Loss
from ggpipe.frontends.serve.replies import sse
from ggpipe.frontends.serve.resume import HEADER, TOKENS, resumed_body
from ggpipe.frontends.supervisor import JobWatch

#: Times one request is sent to a new job after the job running it lost a rank.
RESENDS = 2
#: Seconds a request sent again from its prompt waits at most behind the streams cut in the middle.
BEHIND_MAX_S = 5.0
#: The paths whose requests are sent again (the rest are answered once, or 503 while recovering).
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
#: Headers that belong to one connection, not to the request.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization",
        "proxy-connection", "content-length"}
_LISTENING = re.compile(r"^ggpipe serve: listening on http://\S+?:(\d+)/v1 (.*)$", re.S)


class Backend:
    """The job's server as the front end sees it: its port while it serves,
    a new ``epoch`` for each job, or why there will be none.

    Thread-safe: the supervisor's threads set it, the HTTP thread reads it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.port: int | None = None
        self.epoch = 0
        self.failed: str | None = None
        self.lost_at: float | None = None
        self.first = 0     # streams cut in the middle, on their way to the new job
        self.stopping = False   # the command was asked to stop: a job's answers as it stops are passed on
        disable_created_metrics()
        r = self.registry = CollectorRegistry()
        self.recoveries = Counter("ggpipe_recoveries", "Jobs started again after a lost rank", registry=r)
        self.resent = Counter("ggpipe_requests_resumed", "Requests sent again to a new job after a lost rank",
                              registry=r)
        self.down_seconds = Counter("ggpipe_seconds_without_service", "Seconds from a lost rank until the new job "
                                    "served", registry=r)

    def up(self, port: int) -> None:
        """The job serves on ``port``."""
        with self._lock:
            self.port, self.epoch = port, self.epoch + 1
            if self.lost_at is not None:
                self.down_seconds.inc(time.monotonic() - self.lost_at)
                self.recoveries.inc()
                self.lost_at = None

    def down(self) -> None:
        """The job lost a rank: requests wait for the next one."""
        with self._lock:
            self.port = None
            if self.lost_at is None:
                self.lost_at = time.monotonic()

    def fail(self, reason: str) -> None:
        """No job will serve again (``reason``, one line)."""
        with self._lock:
            self.port, self.failed = None, reason

    @property
    def recovering(self) -> bool:
        """A job lost a rank and the next one does not serve yet."""
        return self.port is None and self.failed is None and self.lost_at is not None

    async def serving(self, after_epoch: int = 0, poll_s: float = 0.05, behind: bool = False) -> tuple[int, int]:
        """Wait for a job that serves, newer than ``after_epoch``: its (port,
        epoch). The wait ends when a job serves or none ever will (bounded
        by the supervisor: a job either starts, or the command ends).
        ``behind``: a request sent again from its prompt also waits until
        the streams cut in the middle (:meth:`first_in_line`) have reached
        the new job (at most :data:`BEHIND_MAX_S` seconds), so that they
        take its slots first, as vLLM puts preempted requests back at the
        head of its waiting queue.

        Raises:
            Unavailable: no job will serve again.
        """
        since = None
        while True:
            with self._lock:
                if self.failed is not None:
                    raise Unavailable(self.failed)
                if self.port is not None and self.epoch > after_epoch:
                    since = since if since is not None else time.monotonic()
                    if not behind or not self.first or time.monotonic() - since >= BEHIND_MAX_S:
                        return self.port, self.epoch
            await asyncio.sleep(poll_s)

    @contextlib.contextmanager
    def first_in_line(self):
        """While a stream cut in the middle waits for the new job and is
        sent to it: requests sent again from their prompts wait behind it."""
        with self._lock:
            self.first += 1
        try:
            yield
        finally:
            with self._lock:
                self.first -= 1


class Unavailable(Exception):
    """No job will serve again (the message says why)."""


def _error(status: int, message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _unavailable(why: str) -> JSONResponse:
    return JSONResponse(_error(503, f"the pipeline is gone: {why}", "pipeline_failed"), status_code=503)


def _send_again(error, backend: Backend) -> bool:
    """Whether the job's error answer (its ``error`` object) sends the
    request to the next job: its pipeline failed (a lost rank), or it
    dropped the request as it stopped (the launcher ends the whole job when
    a rank is lost, and the head may answer before it goes) while this
    command goes on."""
    code = error.get("code") if isinstance(error, dict) else None
    return code == "pipeline_failed" or (code == "shutdown" and not backend.stopping)


def _error_of(body: bytes):
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None


class FrontEnd(JobWatch):
    """The supervisor's watch for ``serve``: learns the job's port from its
    "listening" line, tells the :class:`Backend` of losses and of the end."""

    pipe_stdout = True

    def __init__(self, backend: Backend, public_url: str):
        self.backend, self.public_url = backend, public_url
        self.said = False
        self.answered = 0   # requests answered (progress)

    def stdout_line(self, line: str) -> None:
        m = _LISTENING.match(line)
        if m is None:
            sys.stdout.write(line)
        else:
            self.backend.up(int(m.group(1)))
            if not self.said:   # the first job's line, with the address clients use
                sys.stdout.write(f"ggpipe serve: listening on {self.public_url} {m.group(2)}")
                self.said = True
        sys.stdout.flush()

    def lost(self, loss: Loss) -> None:  # noqa: ARG002 (the supervisor says which rank)
        self.backend.down()

    def progress(self) -> int:
        return self.answered

    def ended(self, reason: str) -> None:
        self.backend.fail(reason)

    def stopping(self) -> None:
        self.backend.stopping = True


def create_front_app(backend: Backend, watch: FrontEnd, max_body_bytes: int, max_connections: int,
                     key: str) -> Starlette:
    """The front end's ASGI app: every path passed on to the job's server;
    ``/health`` answers ``recovering`` meanwhile; ``/metrics`` adds the
    recovery counters. ``key``: the one the jobs were started with
    (ggpipe.frontends.serve.resume), sent with every completion request."""
    clients: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        if "c" not in clients:
            clients["c"] = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None),
                                             limits=httpx.Limits(max_connections=max_connections))
        return clients["c"]

    async def send(port: int, method: str, target: str, headers, body: bytes) -> httpx.Response:
        """The request sent to the job serving on ``port``; its answer's
        body is read as it comes (``aiter_lines``, ``aread``).

        Raises:
            httpx.HTTPError: the job cannot be reached."""
        return await client().send(client().build_request(method, f"http://127.0.0.1:{port}{target}",
                                                          headers=[*headers, (HEADER, key)], content=body),
                                   stream=True)

    async def handle(request: Request) -> Response:
        path = request.url.path
        if path == "/health" and backend.port is None:
            if backend.failed is not None:
                return JSONResponse({"status": "failed", "error": backend.failed}, status_code=503)
            return JSONResponse({"status": "recovering" if backend.recovering else "loading"}, status_code=503)
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                return JSONResponse(_error(413, f"the request body is larger than --max-body-bytes "
                                                f"({max_body_bytes} bytes)", "body_too_large"), status_code=413)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        target = path + (f"?{request.url.query}" if request.url.query else "")
        if request.method == "POST" and path in COMPLETIONS:
            return await _completion(request.method, target, headers, body)
        try:
            port, _ = await backend.serving()
            r = await client().request(request.method, f"http://127.0.0.1:{port}{target}", headers=headers,
                                       content=body)
        except Unavailable as e:
            return _unavailable(str(e))
        except httpx.HTTPError:
            return JSONResponse(_error(503, "the pipeline is recovering from a lost rank; retry", "recovering"),
                                status_code=503)
        content = r.content
        if path == "/metrics" and r.status_code == 200:
            content += generate_latest(backend.registry)
        return Response(content, r.status_code, headers=_passed_back(r.headers))

    async def _completion(method: str, target: str, headers, body: bytes) -> Response:
        epoch = 0
        for attempt in range(RESENDS + 1):
            try:
                port, epoch = await backend.serving(epoch, behind=attempt > 0)
            except Unavailable as e:
                return _unavailable(str(e))
            if attempt:
                backend.resent.inc()
            try:
                r = await send(port, method, target, headers, body)
            except httpx.HTTPError:
                continue
            if r.headers.get("content-type", "").startswith("text/event-stream") and r.status_code == 200:
                return StreamingResponse(_events(r, method, target, headers, body, epoch),
                                         headers=_passed_back(r.headers), status_code=200)
            try:
                content = await r.aread()
            except httpx.HTTPError:
                continue
            finally:
                await r.aclose()
            if r.status_code == 503 and _send_again(_error_of(content), backend):
                continue
            watch.answered += 1
            return Response(content, r.status_code, headers=_passed_back(r.headers))
        return JSONResponse(_error(503, f"the pipeline lost a rank {RESENDS + 1} times while running this "
                                        f"request", "pipeline_failed"), status_code=503)

    async def _events(first: httpx.Response, method, target, headers, body: bytes, epoch: int):
        """The job's server-sent events, passed on; after a lost rank, the
        new job's, which go on after the text already sent."""
        resend = _Resend(lambda error: _send_again(error, backend))
        r = first
        try:
            for attempt in range(RESENDS + 1):
                try:
                    async for line in r.aiter_lines():
                        out = resend.event(line)
                        if out == _FAILED:
                            break
                        if out:
                            yield out
                        if resend.done:
                            watch.answered += 1
                            return
                except httpx.HTTPError:
                    pass
                finally:
                    await r.aclose()
                if attempt == RESENDS:
                    break
                while True:   # the job lost a rank: the next one goes on after the tokens sent
                    cut = resend.tokens != []     # in the middle: first in line; else behind those
                    with backend.first_in_line() if cut else contextlib.nullcontext():
                        try:
                            port, epoch = await backend.serving(epoch, behind=not cut)
                        except Unavailable as e:
                            yield sse(_error(503, f"the pipeline is gone: {e}", "pipeline_failed")) \
                                + "data: [DONE]\n\n"
                            return
                        backend.resent.inc()
                        try:
                            r = await send(port, method, target, headers, resend.body(body))
                            break
                        except httpx.HTTPError:
                            continue
            yield sse(_error(503, f"the pipeline lost a rank {RESENDS + 1} times while running this request",
                              "pipeline_failed")) + "data: [DONE]\n\n"
        finally:
            await r.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", handle, methods=methods)])


def _passed_back(headers: httpx.Headers) -> dict:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


_FAILED = object()


class _Resend:
    """The events of one streamed reply across the jobs that run it: passes
    them on (the chunks' ``id`` and ``created`` stay the first job's, a later
    job's opening chunk is left out) and keeps the token ids and the text
    sent, from which the next job goes on."""

    def __init__(self, again):
        self.again = again      # error object -> the request goes to the next job (else passed on)
        self.sent = ""          # the reply's text sent so far
        self.tokens: list[int] = []    # the token ids whose text holds it
        self.first: dict | None = None
        self.role_sent = False
        self.done = False

    def body(self, request: bytes) -> bytes:
        """The request's body for the next job: to go on after the tokens sent."""
        return resumed_body(request, self.tokens, len(self.sent))

    def event(self, line: str):
        """What to send for one line of the job's stream: text, "" (nothing),
        or :data:`_FAILED` (an error that sends the request to the next job)."""
        if not line.startswith("data: "):
            return ""
        data = line[6:]
        if data == "[DONE]":
            self.done = True
            return "data: [DONE]\n\n"
        try:
            obj = json.loads(data)
        except ValueError:
            return line + "\n\n"
        if not isinstance(obj, dict):
            return line + "\n\n"
        if "error" in obj:
            if self.again(obj["error"]):
                return _FAILED
            return sse(obj)
        ids = obj.pop(TOKENS, None)
        if isinstance(ids, list):
            self.tokens += ids
        if self.first is None:
            self.first = {"id": obj.get("id"), "created": obj.get("created")}
        obj.update({k: v for k, v in self.first.items() if k in obj})
        choices = obj.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return sse(obj)    # the usage chunk
        c = choices[0]
        delta = c.get("delta") if isinstance(c.get("delta"), dict) else None
        if delta is not None and "role" in delta:
            if self.role_sent:
                return ""       # the first job sent the opening chunk
            self.role_sent = True
        self.sent += (delta.get("content") if delta is not None else c.get("text")) or ""
        return sse(obj)


def run_front(argv: list[str], n_ranks: int, hostfile: str | None, host: str, port: int, limits,
              max_body_bytes: int, mpiexec: str = "mpiexec") -> int:
    """``ggpipe serve --ranks N ...``: listen on ``host``:``port``, run the
    job (the same command without ``--ranks``/``--hostfile``, on a loopback
    port of its own) under a :class:`~ggpipe.frontends.supervisor.Supervisor`
    and pass every request on to it; returns the exit code.

    Raises:
        ConfigError: the address cannot be bound, a hostfile that cannot be
            read, no such launcher, one that cannot be started.
    """
    from ggpipe.cluster.plan import parse_hostfile
    from ggpipe.cluster.recovery import RecoveryPolicy
    from ggpipe.frontends.serve.http_protocol import GuardedServer, bind_socket, guarded_config
    from ggpipe.frontends.serve.resume import KEY_ENV
    from ggpipe.frontends.supervisor import Supervisor, job_argv

    hosts = parse_hostfile(hostfile) if hostfile is not None else None
    key = secrets.token_hex(16)
    supervisor = Supervisor(job_argv(argv, ("--host", "--port")) + ["--host", "127.0.0.1", "--port", "0"],
                            RecoveryPolicy(n_ranks, hosts), mpiexec=mpiexec, env={KEY_ENV: key})
    sock = bind_socket(host, port)
    url = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}/v1"
    backend = Backend()
    watch = supervisor.watch = FrontEnd(backend, url)
    app = create_front_app(backend, watch, max_body_bytes, limits.max_connections, key)
    http = GuardedServer(guarded_config(app, limits, log_level="warning", lifespan="off", access_log=False), limits)
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="ggpipe-front", daemon=True)
    thread.start()
    try:
        return supervisor.run()
    finally:
        http.should_exit = True
        thread.join(15.0)
        sock.close()
