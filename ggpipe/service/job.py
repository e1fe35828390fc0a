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
from ggpipe.cluster.recovery import write_ready
from ggpipe.cluster.session import Session, open_session
from ggpipe.decoding.plan import DecodingPlan


@dataclass(frozen=True)
class JobSpec:
    """What every rank needs to start: the cluster settings and how it decodes.

    Attributes:
        config: settings compared between ranks at start-up.
        plan: the decoding plan (mode, speculation settings, slots,
            micro-batches), resolved once from the command line.
        ignore_eos: keep generating after end-of-generation tokens.
    """

    config: ClusterConfig
    plan: DecodingPlan = field(default_factory=DecodingPlan.resolve)
    ignore_eos: bool = False


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
    session = open_session(job.config, async_head=job.plan.async_head, workload=workload)
    try:
        if not session.is_head:
            session.serve(mid_run_cancels=job.plan.cancels_runs)
            return 0
        write_ready([f"rank {r} ({session.hosts[r]}): {session.described.get(r, 'the whole model')}"
                     for r in range(session.size)])   # a supervisor waits for it (ggpipe/frontends/supervisor.py)
        try:
            code = head(Engine(session, job.plan, ignore_eos=job.ignore_eos))
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
