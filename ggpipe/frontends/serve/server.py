"""``ggpipe serve``: an OpenAI-compatible HTTP server on the head rank.

    mpiexec -n 2 ggpipe serve -m smollm2-135m --port 8080
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "What is MPI?"}], "max_tokens": 32}'

Threads on the head: uvicorn serves HTTP (ggpipe.frontends.serve.app) on a
background thread; the main thread owns the engine (every MPI call and the
pipeline happen there). Its request loop (ggpipe.frontends.serve.slots)
takes requests from a FIFO queue into the engine as slots free up (one at a
time with ``--parallel 1``), streaming each piece of text back to the
request's handler.
The other ranks serve their pipeline stage as in every front end.

Defaults of a request come from the command line (``-n`` is the default
``max_tokens``, ``--temp``/``--top-p``/``--top-k``/``--seed`` the default
sampling; ``--temp 0``, the default, is greedy). Greedy output is the same as
``ggpipe generate`` for the same prompt (``/v1/chat/completions`` with one
user message = ``generate --chat``).

Shutdown: SIGINT or SIGTERM (``mpiexec`` forwards both to every rank; the
workers ignore them) stops accepting requests, lets the running request
finish (interrupted after ``--shutdown-grace`` seconds, or at once on a second
signal; a reply cut that way is answered 503 "the reply was cut after N
tokens", or, when streaming, ends with that error event instead of a
finish_reason), fails the queued ones with 503, shuts the pipeline down and
exits 0. Until the running reply ends, the server keeps listening: new
requests get 503 and ``/health`` answers 503 ``shutting_down``.

Access: besides the API key (``--api-key-file`` or ``GGPIPE_API_KEY``; an
``--api-key`` on the command line is visible in every rank's
``/proc/PID/cmdline``), the Host header must be an IP address, localhost or an
``--allowed-hosts`` name (DNS rebinding), a browser origin must be in
``--allowed-origins`` (CORS; none by default), POST bodies must be
``application/json`` and at most ``--max-body-bytes`` (ggpipe.frontends.serve.http_guard).

Floods: at most ``--max-connections`` connections are open (beyond it the
oldest one without a whole request is closed, or the new one gets 503), a
request's headers and body must arrive within ``--read-timeout`` seconds,
and refused connections make one log line a second at most
(ggpipe.frontends.serve.http_limits).

While no request comes, the head sends a no-op KV operation down every
pipeline now and then, so that worker ranks, whose wait between
transactions is bounded, know the head is alive.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path

from ggpipe.errors import ConfigError
from ggpipe.service.engine import Engine
from ggpipe.service.job import JobSpec, head_signals, ignore_signals, run_job
from ggpipe.frontends.serve.http_guard import Access
from ggpipe.frontends.serve.http_limits import ConnectionLimits, default_max_connections
from ggpipe.frontends.serve.http_protocol import GuardedServer, bind_socket, guarded_config
from ggpipe.frontends.serve.app import create_app
from ggpipe.frontends.serve.bodies import pipeline_failed, shutting_down
from ggpipe.frontends.serve.state import ServerState
from ggpipe.frontends.serve.slots import SlotLoop
from ggpipe.sampling_params import SamplingParams


def read_api_key(api_key: str | None, api_key_file: Path | None, env: dict | None = None) -> str | None:
    """The API key from ``--api-key``, ``--api-key-file`` (its first line,
    spaces around it dropped) or ``GGPIPE_API_KEY``.

    Raises:
        ConfigError: an empty key (it would turn authentication off without
            a word), both options given, or an unreadable key file.
    """
    env = os.environ if env is None else env
    if api_key is not None and api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            text = Path(api_key_file).read_text(encoding="utf-8")
            api_key = (text.splitlines() or [""])[0].strip()   # the first line (the help says so)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --api-key-file {api_key_file}: {getattr(e, 'strerror', None) or e}") \
                from None
        if not api_key:
            raise ConfigError(f"--api-key-file {api_key_file}: its first line is empty: an empty key would turn authentication off")
        return api_key
    if api_key is None and "GGPIPE_API_KEY" in env:
        api_key = env["GGPIPE_API_KEY"]
        if not api_key.strip():
            raise ConfigError("GGPIPE_API_KEY is set but empty: an empty key would turn authentication off; "
                              "unset it to serve without a key")
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: an empty key would turn authentication off; leave the option out "
                          "to serve without a key")
    return api_key


class Server:
    """The head's side: the HTTP thread and the request loop.

    Args:
        engine: the head's engine.
        host, port: where to listen (port 0: a free port, printed at start).
        api_key: bearer token required on every endpoint but /health, or None.
        n_predict, sampling: request defaults.
        model_id: the model name clients see (default: the GGUF file's stem).
        max_queue: most waiting requests (more get 503).
        shutdown_grace_s: how long the running request may go on after a
            shutdown signal.
        special_in_messages: special-token text in a chat message becomes
            special tokens (the old behaviour; by default it stays text).
        limits: the connection cap and read time limit
            (ggpipe.frontends.serve.http_limits; default: its defaults).
    """

    def __init__(self, engine: Engine, host: str, port: int, api_key: str | None, n_predict: int,
                 sampling: SamplingParams, model_id: str | None = None, max_queue: int = 64,
                 shutdown_grace_s: float = 30.0, access: Access | None = None, special_in_messages: bool = False,
                 limits: ConnectionLimits | None = None):
        self.engine = engine
        self.limits = limits or ConnectionLimits(default_max_connections())
        self.host = host
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        session = engine.session
        self.state = ServerState(
            tokenize=lambda p, msgs: engine.tokenize(p, msgs, special_in_messages), model_id=model_id or Path(session.model_path).stem,
            n_ctx=engine.n_ctx, n_vocab=int(session.stage.n_vocab), n_predict=n_predict, sampling=sampling,
            piece=engine.vocab.piece, is_eog=engine.vocab.is_eog,
            api_key=api_key, max_queue=max_queue, access=access or Access(),
            info={"mode": engine.mode, "ranks": session.size, "hosts": session.hosts,
                  "chat_template": bool(engine.vocab.chat_template()),
                  "micro_batches": engine.loop.depth,
                  "kernels": lambda: engine.kernels},   # the row probe: at start-up in a speculative mode, else on the first /v1/models
            parallel=engine.parallel, slots=engine.loop.view, tokens_per_s=engine.loop.tokens_per_s,
            step_tokens=engine.loop.step_tokens)
        self.shutdown_grace_s = shutdown_grace_s
        self.deadline: float | None = None  # interrupt the running request after this (monotonic)
        self.signals = 0
        self.http = None
        self.thread: threading.Thread | None = None
        # the request loop (ggpipe.frontends.serve.slots), for one request at a time as for many
        self.slots = SlotLoop(engine, self.state, lambda: self.deadline, shutdown_grace_s,
                              lambda: self.thread is not None and self.thread.is_alive())
        if session.liveness is not None:
            session.liveness.before_abort.append(self.on_rank_failure)

    def on_rank_failure(self, message: str) -> None:
        """A rank died or hangs and the job is about to be aborted (called
        from the liveness thread): report unhealthy, answer the running and
        queued requests with 503 instead of leaving them hanging."""
        self.state.failed = "the pipeline failed: a rank stopped answering or ended (see the server's log)"
        self.state.stopping.set()
        rids = self.slots.fail_all() + self.fail_queued(pipeline_gone=True)
        sys.stderr.write(f"ggpipe serve: the pipeline failed: {message}" +
                         (f"; requests answered 503: {', '.join(rids)}\n" if rids else "\n"))
        sys.stderr.flush()

    # -- signals -------------------------------------------------------------------------

    def on_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        """SIGINT/SIGTERM handler: stop taking requests (503, ``/health`` says
        ``shutting_down``); the running request may go on for
        ``shutdown_grace_s`` seconds, a second signal interrupts it at once."""
        self.signals += 1
        now = time.monotonic()
        self.deadline = now if self.signals > 1 else now + self.shutdown_grace_s
        self.state.stopping.set()  # new requests get 503; /health says "shutting_down" until the reply ends

    # -- HTTP thread -----------------------------------------------------------------------

    def start_http(self, timeout_s: float = 30.0) -> None:
        """Start uvicorn on its thread; wait (bounded) until it serves.

        Raises:
            ConfigError: uvicorn did not start within ``timeout_s``.
        """
        cfg = guarded_config(create_app(self.state), self.limits, log_level="warning", lifespan="off",
                             timeout_graceful_shutdown=int(self.shutdown_grace_s) + 10, access_log=False)
        self.http = GuardedServer(cfg, self.limits)
        self.thread = threading.Thread(target=self.http.run, kwargs={"sockets": [self.sock]}, name="ggpipe-http",
                                       daemon=True)
        self.thread.start()
        t_end = time.monotonic() + timeout_s
        while not self.http.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise ConfigError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)

    def stop_http(self, timeout_s: float = 15.0) -> None:
        """Ask uvicorn to exit, wait up to ``timeout_s`` seconds for its thread,
        and close the listening socket."""
        if self.http is not None:
            self.http.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.sock.close()

    # -- the request loop (main thread) --------------------------------------------------------

    def fail_queued(self, pipeline_gone: bool = False) -> list[str]:
        """Answer every queued request with 503: the server is shutting down
        (:func:`~ggpipe.frontends.serve.bodies.shutting_down`), or with
        ``pipeline_gone`` its pipeline failed; returns their ids."""
        rids = []
        while True:
            try:
                job = self.state.jobs.get_nowait()
            except queue.Empty:
                return rids
            job.finished = True
            job.push("error", pipeline_failed(job.rid) if pipeline_gone else shutting_down())
            rids.append(job.rid)

    def serve(self) -> int:
        """Run requests until a shutdown signal; returns 0."""
        self.start_http()
        engine = self.engine
        how = ("requests run one at a time, in order" if engine.parallel == 1 else
               f"up to {engine.parallel} requests at once ({engine.n_ctx} KV cells each)")
        sys.stdout.write(f"ggpipe serve: listening on http://{_url_host(self.host)}:{self.port}/v1 "
                         f"(model {self.state.model_id}, {engine.mode}, {engine.session.size} ranks); {how}\n")
        sys.stdout.flush()
        try:
            self.slots.run()
            sys.stderr.write("ggpipe serve: shutting down\n")
        finally:
            self.state.stopping.set()
            self.fail_queued()
            self.stop_http()
            self.fail_queued()
        return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def run_serve(job: JobSpec, host: str, port: int, api_key: str | None, n_predict: int, sampling: SamplingParams,
              model_id: str | None = None, max_queue: int = 64, shutdown_grace_s: float = 30.0,
              access: Access | None = None, special_in_messages: bool = False,
              limits: ConnectionLimits | None = None) -> int:
    """Entry point of every rank; returns the exit code (0 after a signal).
    ``special_in_messages``, ``limits``: see :class:`Server`.

    Raises:
        ConfigError: the address cannot be bound; bad settings.
    """
    ignore_signals()

    def head(engine: Engine) -> int:
        server = Server(engine, host, port, api_key, n_predict, sampling, model_id, max_queue, shutdown_grace_s,
                        access, special_in_messages, limits)
        with head_signals(server.on_signal):
            return server.serve()

    return run_job(job, head)
