"""A watchdog around ``MPI_Init``: the one wait ggpipe cannot bound from Python.

``MPI_Init`` (run by the first ``from mpi4py import MPI``) holds the GIL while
it waits for every process of the job to reach it, so no Python thread, time-out
or signal handler can run there. A process of the job that never calls it (a
command that is not ggpipe, a rank that died before it) leaves every other
rank spinning inside it, silently, for as long as the launcher lets it.

:func:`init_watchdog` forks a small child before the import. The child ends
quietly when the import returns (or the rank exits). It ends the rank, with
one line naming it, when

* the launcher signals that another process of the job ended (SIGUSR1 from
  hydra under ``-disable-auto-cleanup``): Python's C-level signal handler
  writes the signal number to a wakeup fd even while the main thread is
  inside ``MPI_Init`` (:func:`signal.set_wakeup_fd`), and that fd is the
  child's pipe, so this is immediate; or
* ``GGPIPE_INIT_TIMEOUT`` seconds pass (default 30).
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import time
from contextlib import contextmanager
from collections.abc import Iterator

from ggpipe.transport.rank_guard import mark_reported

DEFAULT_TIMEOUT_S = 30.0  # room for ranks that start seconds apart (ssh launch, Python on NFS)


def init_timeout_s(env=None, strict: bool = False) -> float:
    """``GGPIPE_INIT_TIMEOUT`` in ``env`` (default: the process's; seconds, a
    finite number > 0), else the default 30 s. A bad value gives the default,
    or with ``strict`` (the start-up check, ggpipe.env_check) an error.

    Raises:
        ConfigError: with ``strict``, a value that is not a number > 0.
    """
    text = (os.environ if env is None else env).get("GGPIPE_INIT_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if math.isfinite(v) and v > 0:
        return v
    if strict:
        from ggpipe.errors import ConfigError  # noqa: PLC0415

        raise ConfigError(f"GGPIPE_INIT_TIMEOUT={text!r}: give the seconds the ranks may take to meet, a number > 0")
    return DEFAULT_TIMEOUT_S


def _child(r: int, parent: int, rank: int | None, timeout_s: float) -> None:
    """Body of the watchdog process (never returns)."""
    try:
        who = f"rank {rank} ({socket.gethostname()}, pid {parent})" if rank is not None else f"pid {parent}"
        deadline = time.monotonic() + timeout_s
        why = None
        while why is None:
            left = deadline - time.monotonic()
            if left <= 0:
                why = (f"MPI start-up (MPI_Init) did not complete within {timeout_s:g} s: a process of this job "
                       f"never started MPI (a command that is not ggpipe, or a rank that ended first); stopping "
                       f"(GGPIPE_INIT_TIMEOUT sets the limit)")
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            data = os.read(r, 256)
            if not data or b"k" in data:  # the import returned (or the rank is gone): nothing to do
                os._exit(0)
            if bytes([signal.SIGUSR1]) in data:
                why = ("another process of this job ended during MPI start-up (mpiexec signalled it; its own "
                       "output says which); stopping")
        if os.getppid() == parent:
            os.write(2, f"ggpipe: error: {who}: {why}\n".encode())
            mark_reported()  # the rank's guard (transport/rank_guard.py) need not name it again
            os.kill(parent, signal.SIGKILL)
    except BaseException:  # noqa: BLE001 - the watchdog must never outlive or hurt the rank
        pass
    os._exit(0)


@contextmanager
def init_watchdog(rank: int | None, timeout_s: float | None = None) -> Iterator[None]:
    """Guard the block that initialises MPI (see the module docstring).

    Args:
        rank: this process's rank as the launcher gives it (for the message).
        timeout_s: limit in seconds (default :func:`init_timeout_s`).
    """
    timeout_s = init_timeout_s() if timeout_s is None else timeout_s
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        _child(r, parent, rank, timeout_s)
    os.close(r)
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the time-out still holds
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.set_wakeup_fd(old)
        try:
            os.write(w, b"k")
        except OSError:
            pass
        os.close(w)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
