"""MPI point-to-point transport with bounded, core-yielding waits.

* Sends are non-blocking (``Isend``) and the sent array is kept alive until
  MPI completes the request, so a stage never waits for the next one to be
  ready (PipeInfer IV.A.1 "buffered implementation").
* Large messages use MPI's rendezvous protocol, which only moves data while
  the sender is inside MPI. A stage spends most of its time inside
  ``llama_decode``, so :meth:`Transport.computing` runs a progress thread
  that tests the pending requests meanwhile (ctypes calls into llama.cpp
  release the GIL).
* Every wait is an ``Iprobe``/``Test`` loop: it probes without sleeping for
  ``spin_s`` (a message that is about to arrive costs no sleep latency), then
  sleeps between probes with back-off from ``poll_min_s`` to ``poll_max_s``,
  instead of a blocking ``Recv``, which spins a full core with PyPI MPICH
  (NOTES-llamacpp, "MPI waiting burns a core"). The process's timer slack is
  set to 1 us (``prctl(PR_SET_TIMERSLACK)``) so short sleeps are not
  stretched to 50 us. Every wait has a time-out whose error names the rank
  waited for and what for.
* While the rank computes, the progress thread probes at most every
  ``poll_compute_s`` (1 ms): it shares the stage's core, and probing every
  100 us took 10-25% of the computation's time on a busy 2-core host
  (docs/design/how-it-works.md, Waiting); a cancellation then lands up to 1 ms late, a
  small part of the 10-100 ms a cancelled run would have cost.
* Where a host's ranks run more threads than it has CPUs, the session
  raises ``poll_max_s`` to 1 ms too (``ggpipe.cluster.resources.host_is_oversubscribed``):
  a waiting rank's wake-ups there take the core of a stage that computes
  (docs/user-guide/parallel.md, Micro-batches). Elsewhere it stays 100 us: a waiting rank's
  own cores are idle, and a hop's latency counts.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from ggpipe.errors import ProtocolError, RankTimeoutError
from ggpipe.transport import link as _link
from ggpipe.transport.messages import TYPE_NAMES
from ggpipe.transport.progress import PollingHelper
from ggpipe.transport.rank_guard import mark_reported, set_doing

_DTYPES = {np.dtype(np.int32): "INT32_T", np.dtype(np.float32): "FLOAT", np.dtype(np.int8): "INT8_T"}


def mpi_world():
    """(comm, rank, size) of MPI_COMM_WORLD, or None when ggpipe was not
    started by an MPI launcher (then no MPI library is needed at all)."""
    import os  # noqa: PLC0415

    launched = any(
        k in os.environ
        for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
    )
    if not launched:
        return None
    if "mpi4py.MPI" not in sys.modules:  # the import runs MPI_Init: guard it (transport/init_watchdog.py)
        from ggpipe.transport.init_watchdog import init_watchdog  # noqa: PLC0415
        from ggpipe.transport.launcher_signal import launched_rank  # noqa: PLC0415

        set_doing("starting MPI (MPI_Init)")
        with init_watchdog(launched_rank()):
            from mpi4py import MPI  # noqa: PLC0415
        set_doing("meeting the other ranks")
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm, comm.Get_rank(), comm.Get_size()


def thread_level_problem() -> str | None:
    """None when the MPI library gives ``MPI_THREAD_MULTIPLE``, else why
    ggpipe cannot run on it: the head's stage executor, its main thread and
    every rank's heartbeat thread all call MPI (call after :func:`mpi_world`)."""
    from mpi4py import MPI  # noqa: PLC0415

    got = MPI.Query_thread()
    if got == MPI.THREAD_MULTIPLE:
        return None
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
    return (f"the MPI library gives {names.get(got, got)}, but ggpipe calls MPI from several threads and needs "
            f"MPI_THREAD_MULTIPLE: use an MPI built with thread support (pip install \"ggpipe[mpich]\" has it), "
            f"and do not lower mpi4py's thread level (MPI4PY_RC_THREAD_LEVEL)")


def abort_world(comm, code: int, grace_s: float = 0.5) -> None:
    """``MPI_Abort(code)`` on ``comm`` after flushing stdout/stderr and
    waiting ``grace_s`` seconds: the launcher (hydra, orted) forwards a rank's
    output through its proxy, and an abort right after the last write can
    kill the proxy before the error line reaches the user's terminal."""
    mark_reported()  # the error line is out: the rank's guard stays quiet about the abort's signals
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe must not stop the abort
            pass
    time.sleep(grace_s)
    comm.Abort(code)
    # MPI_Abort returns on a rank whose launcher proxy cannot reach mpiexec (a host cut off from the
    # network): end this process anyway, so no rank outlives the job it reported ended
    os._exit(code)


def _tight_timer_slack() -> None:
    """Best effort: 1 us timer slack for this thread (Linux), so a 10 us sleep
    lasts about 10 us rather than the default 50 us slack."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, ns
    except (OSError, AttributeError):
        pass


class Transport:
    """Typed point-to-point messaging for one rank.

    Args:
        comm: an mpi4py communicator.
        hosts: host name of every rank (for error messages), or None.
        timeout_s: default bound of every wait, seconds.
        spin_s: how long a wait probes without sleeping, seconds.
        poll_min_s, poll_max_s: back-off range of the sleep between probes
            (an attribute the session may raise, see the module docstring).
        poll_compute_s: the longest sleep between the probes of
            :meth:`computing` (pending sends, cancellations), seconds.
        idle_after_s, poll_idle_s: a wait longer than ``idle_after_s`` (an
            idle rank, not a pipeline hop) sleeps ``poll_idle_s`` between probes.
        max_pending: sends in flight before :meth:`send` waits for the oldest.
        emulate_link: delay messages as ``GGPIPE_LINK`` asks (False: never).

    Raises:
        ConfigError: ``GGPIPE_LINK`` is malformed (with ``emulate_link``).
    """

    def __init__(self, comm, hosts=None, timeout_s: float = 60.0, spin_s: float = 50e-6,
                 poll_min_s: float = 10e-6, poll_max_s: float = 100e-6, idle_after_s: float = 0.1,
                 poll_idle_s: float = 1e-3, max_pending: int = 256, poll_compute_s: float = 1e-3,
                 emulate_link: bool = True):
        from mpi4py import MPI  # noqa: PLC0415

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.hosts = list(hosts) if hosts else [None] * self.size
        self.timeout_s = timeout_s
        self.spin_s = spin_s
        self.poll_min_s = poll_min_s
        self.poll_max_s = poll_max_s
        self.poll_compute_s = poll_compute_s
        self.idle_after_s = idle_after_s
        self.poll_idle_s = poll_idle_s
        self.max_pending = max_pending
        self._pending: list[tuple[object, object]] = []  # (request, kept-alive buffer)
        self._lock = threading.Lock()
        self._helpers: list[PollingHelper] = []   # idle progress threads (computing() may run in two threads)
        self.bytes_sent = 0
        self.messages_sent = 0
        # GGPIPE_LINK: emulated interconnect (ggpipe/transport/link.py), or None; never for the exchange
        # that carries a start-up error (emulate_link False), which may be GGPIPE_LINK's own
        self._link = _link.from_env() if emulate_link else None
        self.interrupt: Callable[[], None] | None = None  # called while a wait sleeps; may raise to end it
        _tight_timer_slack()

    # -- naming ----------------------------------------------------------------

    def name(self, rank: int) -> str:
        """``rank N (host)`` for messages (the host where known)."""
        host = self.hosts[rank] if 0 <= rank < len(self.hosts) else None
        return f"rank {rank}" + (f" ({host})" if host else "")

    # -- sending ---------------------------------------------------------------

    def send(self, dest: int, tag: int, array: np.ndarray) -> None:
        """Start sending a C-contiguous int32/float32/int8 array; returns at once.
        The array must not be modified afterwards (it is kept until sent)."""
        array = np.ascontiguousarray(array)
        if self._link is not None:  # held until its emulated arrival time; progress() sends it
            with self._lock:
                self._link.hold(dest, array.nbytes, (dest, tag, array))
                self.bytes_sent += array.nbytes
                self.messages_sent += 1
            self.progress()
            return
        mpi_type = getattr(self.MPI, _DTYPES[array.dtype])
        req = self.comm.Isend([array, mpi_type], dest=dest, tag=tag)
        with self._lock:
            self._pending.append((req, array))
            self.bytes_sent += array.nbytes
            self.messages_sent += 1
        self.progress()
        if len(self._pending) > self.max_pending:
            self.flush(what=f"sends to {self.name(dest)} to drain")

    def send_obj(self, dest: int, tag: int, obj) -> None:
        """Send a small picklable object (handshake, statistics)."""
        self.send(dest, tag, np.frombuffer(pickle.dumps(obj), dtype=np.int8))

    def progress(self) -> int:
        """Test pending sends, dropping completed ones; returns how many remain."""
        with self._lock:
            if self._link is not None:
                for dest, tag, a in self._link.due():
                    self._pending.append((self.comm.Isend([a, getattr(self.MPI, _DTYPES[a.dtype])], dest=dest,
                                                          tag=tag), a))
            if self._pending:
                self._pending = [(r, b) for (r, b) in self._pending if not r.Test()]
            return len(self._pending) + (self._link.n_held if self._link is not None else 0)

    def _link_wait_s(self, delay: float) -> float:
        """``delay`` shortened to the next emulated-link release, if sooner."""
        t = self._link.next_release_in() if self._link is not None else None
        return delay if t is None else min(delay, t)

    def flush(self, timeout_s: float | None = None, what: str = "pending sends to complete") -> None:
        """Wait until every pending send has completed."""
        self._wait(lambda: self.progress() == 0, timeout_s, what, None)

    @contextmanager
    def computing(self, on_poll=None):
        """Keep pending sends moving while this thread is busy in llama.cpp,
        and call ``on_poll()`` (e.g. a probe for cancellations) meanwhile:
        from a helper thread, with sleeps backing off from ``poll_min_s``
        to ``poll_compute_s`` between probes (the helper shares the core
        the computation runs on). Helper threads are kept for the
        transport's life, one per thread computing at once
        (ggpipe.transport.progress: a thread per block leaked MPICH's
        per-thread state).

        Raises:
            whatever ``on_poll()`` raised during the block (it stops the
            polling), once the block has ended without an error of its own."""
        if not self._pending and on_poll is None and not (self._link is not None and self._link.n_held):
            yield
            return

        def step() -> bool:
            pending = self.progress()
            if on_poll is not None:
                on_poll()
                return True
            return bool(pending)

        with self._lock:
            helper = self._helpers.pop() if self._helpers else PollingHelper("mpi-progress")
        helper.start(step, self.poll_min_s, self.poll_compute_s, self._link_wait_s)
        try:
            yield
        finally:
            err = helper.stop()
            with self._lock:
                self._helpers.append(helper)
        if err is not None:
            raise err

    # -- receiving -------------------------------------------------------------

    def _wait(self, ready, timeout_s, what, source):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        delay = self.poll_min_s
        while True:
            r = ready()
            if r:
                return r
            waited = time.monotonic() - t0
            if waited < self.spin_s:
                continue
            if self.interrupt is not None:
                self.interrupt()
            if waited > timeout_s:
                src = f" from {self.name(source)}" if source is not None else ""
                waited_for = f"{self.name(self.rank)} waited {waited:.0f} s for {what}{src}"
                raise RankTimeoutError(f"{waited_for}: it stopped answering (raise --timeout if it is only slow)",
                                       waited_for)
            if self._pending and self.progress():
                # a large (rendezvous) send only moves while we are inside MPI:
                # keep driving it with short sleeps until it is done
                time.sleep(self.poll_min_s)
                continue
            if self._link is not None and self.progress():  # emulated link: sleep until the next release
                time.sleep(self._link_wait_s(self.poll_max_s))
                continue
            time.sleep(delay)
            delay = self.poll_idle_s if waited > self.idle_after_s else min(delay * 1.5, self.poll_max_s)

    def probe(self, source: int, tag: int):
        """Non-blocking: the status of a waiting message from ``source`` with
        ``tag`` (MPI.ANY_TAG allowed), or None."""
        if self._link is not None and self._link.n_held:
            self.progress()  # emulated link: every polling loop releases due messages
        st = self.MPI.Status()
        return st if self.comm.Iprobe(source=source, tag=tag, status=st) else None

    def recv(self, source: int, tag: int, dtype, what: str, timeout_s: float | None = None,
             max_items: int | None = None) -> tuple[int, np.ndarray]:
        """Receive one message (waiting at most ``timeout_s``); returns
        ``(tag, array)``. ``tag`` may be MPI.ANY_TAG (a transaction's start).

        Raises:
            RankTimeoutError: nothing arrived in time.
            ProtocolError: the message is not a whole number of ``dtype`` items
                or exceeds ``max_items``.
        """
        dtype = np.dtype(dtype)
        st = self._wait(lambda: self.probe(source, tag), timeout_s, what, source)
        nbytes = st.Get_count(self.MPI.BYTE)
        mtag = st.Get_tag()
        if nbytes % dtype.itemsize:
            self._discard(source, mtag, nbytes)
            raise ProtocolError(f"{what} from {self.name(source)}: {nbytes} bytes is not a whole number of {dtype}")
        n = nbytes // dtype.itemsize
        if max_items is not None and n > max_items:
            self._discard(source, mtag, nbytes)
            raise ProtocolError(f"{what} from {self.name(source)}: {n} items, at most {max_items} expected")
        buf = np.empty(n, dtype=dtype)
        self.comm.Recv([buf, getattr(self.MPI, _DTYPES[dtype])], source=source, tag=mtag)
        return mtag, buf

    def recv_obj(self, source: int, tag: int, what: str, timeout_s: float | None = None):
        """Receive one pickled object (:meth:`send_obj`'s; at most 1 MiB),
        waiting at most ``timeout_s`` seconds.

        Raises:
            RankTimeoutError: nothing arrived in time.
            ProtocolError: the message is too large or cannot be unpickled."""
        _, raw = self.recv(source, tag, np.int8, what, timeout_s, max_items=1 << 20)
        try:
            return pickle.loads(raw.tobytes())
        except Exception as exc:  # noqa: BLE001 - any unpickling failure is a protocol error
            raise ProtocolError(f"{what} from {self.name(source)}: unreadable ({exc})") from None

    def _discard(self, source, tag, nbytes):
        buf = np.empty(nbytes, dtype=np.int8)
        self.comm.Recv([buf, self.MPI.BYTE], source=source, tag=tag)

    def describe_tag(self, tag: int) -> str:
        """The message type's name of ``tag`` (``ggpipe.transport.messages``), or
        ``tag N`` for an unknown one."""
        return TYPE_NAMES.get(tag, f"tag {tag}")
