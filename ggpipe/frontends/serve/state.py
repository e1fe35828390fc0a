"""What the HTTP thread of ``ggpipe serve`` shares with the head's main thread.

:class:`ServerState` holds the model facts, the defaults, the access rules and
the queue of :class:`Job` s (one per request) that the main thread works
through (ggpipe.frontends.serve.server, ggpipe.frontends.serve.slots); a job brings
its text back to the HTTP thread through its asyncio queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
from fastapi import Request

from ggpipe.frontends.serve.http_guard import Access
from ggpipe.frontends.serve.metrics import ServeMetrics
from ggpipe.frontends.serve.resume import job_key
from ggpipe.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ggpipe.service.text import Resume


@dataclass
class Job:
    """One request on its way through the queue. The main thread reports
    through :meth:`push`: ("text", str), ("done", Completion) or ("error",
    APIError); ``cancelled`` is set when the client went away. ``rid``: the
    request's id (its completion's id, and the one the server's log names
    when it fails). ``resume``: the reply begun by another job to go on
    with (ggpipe.service.engine.Resume), or None; ``with_tokens``: a
    ("tokens", ids) event comes before each ("text", str), for the front
    end of ``serve --ranks`` (ggpipe.frontends.serve.resume)."""

    tokens: np.ndarray
    n_predict: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_queued: float = field(default_factory=time.monotonic)
    finished: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    resume: Resume | None = None
    with_tokens: bool = False

    def push(self, kind: str, value) -> None:
        """Hand the event ``(kind, value)`` to the HTTP thread's queue (safe from
        any thread); when the event loop is closed, nobody listens: the job is
        marked cancelled instead."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody listens any more
            self.cancelled.set()


@dataclass
class ServerState:
    """What the app needs from the head: model facts, defaults, the queue.

    Attributes:
        tokenize: (prompt | None, messages | None) -> token ids; thread-safe.
        model_id: the name clients see (``/v1/models``, ``model`` fields).
        n_ctx, n_vocab: the context size and vocabulary size (tokens).
        n_predict: default max_tokens; sampling: default sampling settings.
        piece: token id -> its bytes (the log-probabilities' token texts);
            is_eog: token id -> an end-of-generation token?
        api_key: required bearer token, or None.
        access: Host / Origin allow-lists and the body size limit (http_guard).
        max_queue: most requests waiting; more get 503.
        info: extra ``/v1/models`` metadata (mode, ranks, ...).
        parallel: slots (``--parallel``); n_ctx is then one slot's cells.
        slots: -> the ``/slots`` view (one dict per slot), or None.
        front_key: the key of the front end that started this job
            (``serve --ranks``, ggpipe.frontends.serve.resume), or None.
        tokens_per_s: -> tokens generated per second lately, all requests together.
        step_tokens: -> what the micro-batches carried so far
            (``RequestLoop.step_tokens``), or None.
    """

    tokenize: Callable[[str | None, list | None], np.ndarray]
    model_id: str
    n_ctx: int
    n_vocab: int
    n_predict: int
    sampling: SamplingParams
    piece: Callable[[int], bytes] = lambda t: b""
    is_eog: Callable[[int], bool] = lambda t: False
    api_key: str | None = None
    access: Access = field(default_factory=Access)
    max_queue: int = 64
    info: dict = field(default_factory=dict)
    jobs: queue.Queue = field(default_factory=queue.Queue)
    stopping: threading.Event = field(default_factory=threading.Event)
    failed: str | None = None  # why the pipeline is gone (a rank died): /health says so
    running: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServeMetrics | None = None
    parallel: int = 1
    slots: Callable[[], list[dict]] | None = None
    tokens_per_s: Callable[[], float] | None = None
    step_tokens: Callable[[], dict] | None = None
    front_key: str | None = field(default_factory=job_key)

    def __post_init__(self):
        self.metrics = ServeMetrics(lambda: self.jobs.qsize(), lambda: self.running, self.parallel, self.tokens_per_s,
                                    self.step_tokens)


def state_of(request: Request) -> ServerState:
    """The ServerState of the app serving ``request``."""
    return request.app.state.ggpipe
