"""``ggpipe serve``: the head's request loop, on the main thread beside the
HTTP thread (ggpipe.frontends.serve.app), for every ``--parallel``: the
engine runs up to ``--parallel`` requests at once in its continuous-batching
scheduler, or with ``--parallel 1`` one at a time through the mode's decoder.

Requests move from the HTTP queue (bounded by ``--max-queue``) into the
engine only when a slot is free for them, so the HTTP queue is the one
place requests wait. Each request streams its own text; a request whose
client leaves (streaming or not) is stopped at its next token, or dropped
while still waiting; one that does not fit a slot gets 400; a shutdown
signal stops taking requests, answers the waiting ones with 503 and lets the
running ones finish until ``--shutdown-grace`` (then they are cut and told
so).
"""

from __future__ import annotations

import queue
import sys
import time
from typing import Callable

from ggpipe.errors import GGPipeError
from ggpipe.frontends.serve.bodies import APIError, answer, internal_error, pipeline_failed, shutting_down
from ggpipe.frontends.serve.state import Job, ServerState
from ggpipe.service.engine import Completion, Engine


class SlotLoop:
    """Args:
        engine: the head's engine.
        state: the app's shared state.
        deadline: when running requests must stop (monotonic seconds), or
            None; read at every token.
        grace_s: ``--shutdown-grace`` (named in the answer of a reply it cut).
        http_alive: the HTTP thread still serves.
    """

    def __init__(self, engine: Engine, state: ServerState, deadline: Callable[[], float | None], grace_s: float,
                 http_alive: Callable[[], bool]):
        self.engine = engine
        self.state = state
        self.deadline = deadline
        self.grace_s = grace_s
        self.http_alive = http_alive
        self.jobs: list[tuple[Job, object]] = []   # (HTTP job, scheduler job) not answered yet

    # -- one request -----------------------------------------------------------------

    def _stop(self, job: Job) -> bool:
        d = self.deadline()
        return job.cancelled.is_set() or (d is not None and time.monotonic() >= d)

    def _done(self, job: Job, done: Completion | None, sched_job) -> None:
        if job.finished:
            return
        if done is None:            # dropped while waiting: its client left, or the server stops
            job.finished = True
            if not job.cancelled.is_set():
                job.push("error", shutting_down())
            return
        waited = (sched_job.t_queued - job.t_queued) + sched_job.queue_s
        # finished once answered: a failure in answering it is answered with a 500 by _guarded (_failed)
        answer(self.state, job, done, waited, self.grace_s)
        job.finished = True

    def _request_failed(self, job: Job, exc: BaseException) -> None:
        """The engine refused or ended this request alone: its own settings
        (a :class:`GGPipeError`: 400 with the reason) or an unexpected error
        (:meth:`_failed`)."""
        if isinstance(exc, GGPipeError):
            job.cancelled.set()
            if not job.finished:
                job.finished = True
                job.push("error", APIError(400, str(exc)))
            return
        self._failed(job, exc)

    def _failed(self, job: Job, exc: BaseException) -> None:
        """The request failed unexpectedly (its sampling, a bug in its
        callbacks): 500 for it, its details in the log; it stops at its next
        token (``cancelled``), the others run on."""
        job.cancelled.set()
        if not job.finished:
            job.finished = True
            job.push("error", internal_error(job.rid, exc))

    def _guarded(self, job: Job, fn: Callable, default=None) -> Callable:
        """``fn`` for the scheduler's callbacks: an unexpected exception in it
        fails this request only (:meth:`_failed`) instead of the loop."""
        def call(*args):
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - one request's failure must not end the job
                self._failed(job, e)
                return default
        return call

    def _submit(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.finished = True
            return
        holder: list = []
        try:
            sched_job = self.engine.submit(job.tokens, job.n_predict, job.sampling,
                                           on_text=self._guarded(job, lambda t: job.push("text", t)), stop=job.stop,
                                           should_stop=self._guarded(job, lambda: self._stop(job), True),
                                           on_done=self._guarded(job, lambda done: self._done(job, done, holder[0])),
                                           on_error=lambda e: self._request_failed(job, e),
                                           on_tokens=(self._guarded(job, lambda ids: job.push("tokens", ids))
                                                      if job.with_tokens else None), resume=job.resume)
        except Exception as e:  # noqa: BLE001 - nothing was sent for it: only this request fails (400 or 500)
            self._request_failed(job, e)
            return
        holder.append(sched_job)
        self.jobs.append((job, sched_job))

    # -- the loop ----------------------------------------------------------------------

    def _take(self) -> None:
        """Move requests from the HTTP queue into free slots; with nothing
        running, wait up to 0.25 s for one."""
        jobs = self.state.jobs
        block = not self.engine.busy
        while self.engine.free_slots > 0:
            try:
                job = jobs.get(timeout=0.25) if block else jobs.get_nowait()
            except queue.Empty:
                return
            block = False
            self._submit(job)

    def _drop_left(self) -> None:
        """Forget answered requests; drop waiting ones whose clients left
        (running ones stop through their ``should_stop``)."""
        self.jobs = [(job, sj) for job, sj in self.jobs if not job.finished]
        for job, sj in self.jobs:
            if sj.request is None and job.cancelled.is_set():
                sj.cancelled = True

    def run(self) -> None:
        """Serve until the state says stop, then finish the running requests
        (bounded by the deadline) and drop the waiting ones.

        Raises:
            GGPipeError: the HTTP thread died; pipeline errors."""
        state, engine = self.state, self.engine
        while not state.stopping.is_set():
            if not self.http_alive():
                raise GGPipeError("the HTTP server stopped unexpectedly")
            self._take()
            state.running = engine.running
            if engine.busy:
                try:
                    engine.step(wake=lambda: not state.jobs.empty() and self.engine.free_slots > 0)
                except BaseException as e:
                    # the pipeline failed, or the scheduler itself (no one request's fault): its state is
                    # unknown, so the job ends; answer the requests first instead of leaving them hanging
                    rids = self.fail_all()
                    if rids:
                        sys.stderr.write(f"ggpipe serve: the request loop failed ({type(e).__name__}: {e}); "
                                         f"requests answered 503: {', '.join(rids)}\n")
                    raise
            self._drop_left()
            state.running = engine.running
        for _, sj in self.jobs:
            if sj.request is None:
                sj.cancelled = True
        while engine.busy:
            engine.step()
        engine.drain()
        state.running = 0

    def fail_all(self) -> list[str]:
        """The pipeline failed: answer every running and waiting request
        with 503 (any thread); returns their ids (the caller logs why)."""
        rids = []
        for job, _ in list(self.jobs):
            if not job.finished:
                job.finished = True
                job.push("error", pipeline_failed(job.rid))
                rids.append(job.rid)
        return rids
