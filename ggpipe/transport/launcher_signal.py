"""SIGUSR1 from the MPI launcher, outside the heartbeat watch.

Under ``mpiexec -disable-auto-cleanup`` (what ggpipe's launch commands use)
MPICH's hydra sends SIGUSR1 to a job's other processes whenever one of them
ends, abnormally or not; its default action kills silently. While a rank's
heartbeats run, :class:`ggpipe.transport.liveness.Liveness` handles it (it
names the dead rank). Around that window:

* from process start until the ranks have met (:func:`watch_launcher_signal`,
  installed first thing by the ``ggpipe`` entry point), it is remembered, and
  the start-up wait raises :class:`RankLostError` (:func:`check_launcher_signal`);
* once the watch stops, and through ``MPI_Finalize`` at exit, it is ignored
  (:func:`ignore_launcher_signal`): a rank that ends first must not kill one
  that is still finishing (exit code 10 and hydra's "BAD TERMINATION"
  banner after a good run).

Kept free of heavy imports: the entry point loads it before anything else.
"""

from __future__ import annotations

import os
import signal
import threading

from ggpipe.errors import RankLostError
from ggpipe.transport.rank_guard import RANK_VARS

_startup_signal = threading.Event()


def _first_int(names: tuple[str, ...]) -> int | None:
    """The first of these environment variables that holds an integer."""
    for k in names:
        try:
            return int(os.environ[k])
        except (KeyError, ValueError):
            pass
    return None


def launched_rank() -> int | None:
    """This process's MPI rank as its launcher's environment gives it, or
    None when no MPI launcher started it (read without initialising MPI)."""
    return _first_int(RANK_VARS)


_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "SLURM_NTASKS")


def launched_size() -> int | None:
    """The job's number of ranks as its launcher's environment gives it, or
    None when no MPI launcher started this process (read without
    initialising MPI)."""
    return None if launched_rank() is None else _first_int(_SIZE_VARS)


def watch_launcher_signal() -> None:
    """From process start until the heartbeat watch begins (main thread
    only): remember a SIGUSR1 from hydra instead of dying of it, so the
    start-up wait can report that a rank ended (:func:`check_launcher_signal`)."""
    _startup_signal.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: _startup_signal.set())


def check_launcher_signal() -> None:
    """Raise if the launcher signalled a rank's end since :func:`watch_launcher_signal`.

    Raises:
        RankLostError: naming what is known (a process of this job on this
            host ended before the ranks had met)."""
    if _startup_signal.is_set():
        raise RankLostError(f"another rank of this job on {os.uname().nodename} ended during start-up, "
                            f"before the ranks had met (mpiexec signalled it; its own output says which); "
                            f"stopping every rank")


def ignore_launcher_signal() -> None:
    """Ignore SIGUSR1 (main thread only; elsewhere a no-op).

    Under ``mpiexec -disable-auto-cleanup`` hydra sends SIGUSR1 to the other
    ranks whenever one process ends, including a normal exit: a rank that is
    still in ``MPI_Finalize`` when another has left would die of it (exit
    code 10 and hydra's "BAD TERMINATION" banner after a good run). Python
    restores the default action of signals with Python handlers before
    mpi4py's ``MPI_Finalize`` runs at exit, but leaves ``SIG_IGN`` in place,
    so a rank ignores SIGUSR1 once its heartbeat watch has stopped (and at
    exit: Python's own atexit hooks run before that reset)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
