"""Running one front end as an MPI job: every rank opens the session; the
head runs the front end, the other ranks serve their stage until the head
shuts the pipeline down. Shared by generate, chat, batch and serve.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ggpipe.errors import GGPipeError
from ggpipe.service.engine import Engine
from ggpipe.cluster.config import ClusterConfig
from ggpipe.cluster.session import Session, open_session
from ggpipe.decoding.mode import mode_class
from ggpipe.decoding.settings import SpecSettings


@dataclass(frozen=True)
class JobSpec:
    """What every rank needs to start: the cluster settings and the mode.

    Attributes:
        config: settings compared between ranks at start-up.
        mode: "iterative", "speculative" or "pipeinfer".
        spec: speculation settings (speculative modes).
        ignore_eos: keep generating after end-of-generation tokens.
        parallel: slots of the continuous-batching scheduler (``--parallel``;
            batch and serve); 1: one request at a time.
        micro_batches: the scheduler's micro-batches in flight
            (``--micro-batches``); None: as many as the target's stages can
            compute at once (per host, as many as its CPUs hold their threads).
    """

    config: ClusterConfig
    mode: str = "iterative"
    spec: SpecSettings = field(default_factory=SpecSettings)
    ignore_eos: bool = False
    parallel: int = 1
    micro_batches: int | None = None


def cancels_runs(job: JobSpec) -> bool:
    """Whether the head may cancel a run of this job: one request at a time
    in a mode that declares it may (``Mode.may_cancel``: the asynchronous
    speculative modes with ``--no-cancel`` off). Iterative decoding and the
    ``--parallel`` scheduler never cancel a run (a dropped row's cells are
    removed after it instead)."""
    return job.parallel == 1 and mode_class(job.mode).may_cancel(job.spec)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def ignore_signals(signals=STOP_SIGNALS) -> None:
    """Every rank, before start-up: ``mpiexec`` forwards SIGINT/SIGTERM to all
    ranks, and only the head decides what they mean (stop a reply, finish the
    running request), so workers and the head outside its handler ignore them."""
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


@contextmanager
def head_signals(handler, signals=STOP_SIGNALS) -> Iterator[None]:
    """On the head, route ``signals`` to ``handler`` while the front end runs."""
    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        ignore_signals(signals)


def run_job(job: JobSpec, head: Callable[[Engine], int],
            after_shutdown: Callable[[Session, list[dict]], None] | None = None,
            workload: Callable[[], tuple[int, int] | None] | None = None) -> int:
    """Entry point of every rank; returns the process exit code.

    ``head(engine)`` runs on rank 0 and returns the exit code; then the
    workers are shut down and ``after_shutdown(session, rank_stats)`` is
    called with every rank's statistics (rank order). ``workload``: the
    job's (prompt tokens, most generated tokens), asked on the head before
    loading (:func:`~ggpipe.cluster.session.open_session`), or None.

    Raises:
        GGPipeError: start-up or pipeline errors (the CLI prints one line).
    """
    # the head's stage on its own thread: the asynchronous modes, and the scheduler's
    # micro-batches (the head samples one group while its stage computes the next)
    session = open_session(job.config, async_head=mode_class(job.mode).asynchronous or job.parallel > 1,
                           workload=workload)
    try:
        if not session.is_head:
            session.serve(mid_run_cancels=cancels_runs(job))
            return 0
        try:
            code = head(Engine(session, job.mode, job.spec, ignore_eos=job.ignore_eos, parallel=job.parallel,
                               micro_batches=job.micro_batches))
        except GGPipeError as exc:
            if not exc.abort_job:  # the pipeline is still in step: stop it cleanly
                session.shutdown()
            raise
        ranks = session.shutdown()
        if after_shutdown is not None:
            after_shutdown(session, ranks)
        return code
    finally:
        session.close()
