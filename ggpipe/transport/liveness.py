"""Liveness: heartbeats between the head and every worker, so a rank that
dies (``kill -9``) or hangs (``SIGSTOP``, a stuck node) is reported by name
within seconds, whatever the job is doing (loading, prefill, generation,
idle in a chat or server), and the job is aborted instead of hanging.

Heartbeats travel on a duplicate of the job's communicator, so they never
match the pipeline's probes. Star topology: the head sends to and watches
every worker; each worker sends to and watches the head (the head's abort
takes every rank down; a worker that loses the head aborts the job itself).

The bookkeeping (:class:`HeartbeatMonitor`) is MPI-free and unit-tested;
:class:`Liveness` is its MPI driver thread.

Launchers: MPICH's ``mpiexec`` (hydra) kills the whole job the instant a
rank dies unless it is started with ``-disable-auto-cleanup``; then it prints
its own "BAD TERMINATION" banner with the dead process's PID and host, and
no rank gets to say more. With ``-disable-auto-cleanup`` (ggpipe's cluster
scripts pass it) hydra's proxy instead sends SIGUSR1 to the surviving ranks
of the dead one's host (whose default action would end them silently); this
module catches it, checks at once which rank on this host is gone, names
it, its host and what the job was doing, then calls ``MPI_Abort``. A rank on
another host is found by its missing heartbeats. Before the heartbeats start
(start-up, before the ranks have met) a SIGUSR1 only stops the start-up wait
(``transport/launcher_signal.py``); after they stop it is ignored, because
hydra also sends it when a rank exits normally while another is still
finishing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ggpipe.transport.launcher_signal import ignore_launcher_signal
from ggpipe.transport.mpi import abort_world

HEARTBEAT_TAG = 77
_LEAVING = 1


@dataclass
class HeartbeatMonitor:
    """Last-heard times of peers; MPI-free.

    Args:
        peers: ranks to watch.
        timeout_s: silence after which a peer counts as gone (seconds).
        now: the start time (the first deadline is ``now + timeout_s``).
    """

    peers: list[int]
    timeout_s: float
    now: float
    last: dict[int, float] = field(default_factory=dict)
    departed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.last = {p: self.now for p in self.peers}

    def heard(self, peer: int, t: float, leaving: bool = False) -> None:
        """A heartbeat from ``peer`` at time ``t``; ``leaving``: it is shutting
        down normally and will not send more."""
        if peer in self.last:
            self.last[peer] = max(self.last[peer], t)
            if leaving:
                self.departed.add(peer)

    def overdue(self, t: float) -> list[tuple[int, float]]:
        """(peer, silence in seconds) for every watched peer silent for more
        than ``timeout_s`` at time ``t``, longest silence first."""
        late = [(p, t - s) for p, s in self.last.items() if p not in self.departed and t - s > self.timeout_s]
        return sorted(late, key=lambda x: -x[1])


def process_state(pid: int) -> str:
    """How a process on this host looks: "exited", "stopped" (SIGSTOP) or
    "running" (psutil)."""
    import psutil

    try:
        st = psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "exited"
    if st == psutil.STATUS_ZOMBIE or st == psutil.STATUS_DEAD:
        return "exited"
    if st in (psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop")):
        return "stopped"
    return "running"


class Liveness:
    """Heartbeat thread of one rank.

    Args:
        comm: the job's communicator (duplicated here: collective, every rank
            must construct its Liveness at the same point).
        peers: ranks to exchange heartbeats with.
        timeout_s: silence that counts as a dead or stuck rank (seconds).
        describe: rank -> "rank 2 (host, pid 123, target stage 2)".
        peer_info: rank -> (host, pid) as reported at start-up, or None.
        activity: () -> what this job is doing ("generating", ...).
        on_dead: called with the one-line message instead of printing it and
            aborting (tests); default: print to stderr, ``MPI_Abort(1)``.
    """

    def __init__(self, comm, peers: list[int], timeout_s: float,
                 describe: Callable[[int], str], peer_info: Callable[[int], tuple[str, int] | None],
                 activity: Callable[[], str], on_dead: Callable[[str], None] | None = None):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm.Dup()
        self.rank = comm.Get_rank()
        self.peers = list(peers)
        self.timeout_s = float(timeout_s)
        self.interval_s = min(1.0, max(0.05, self.timeout_s / 10))
        self.describe = describe
        self.peer_info = peer_info
        self.activity = activity
        self.on_dead = on_dead or self._abort
        self.monitor = HeartbeatMonitor(self.peers, self.timeout_s, time.monotonic())
        self._stop = threading.Event()
        self._sends: dict[int, tuple[object, np.ndarray]] = {}  # peer -> (request, kept-alive buffer)
        self._bufs = {p: np.zeros(2, dtype=np.int32) for p in self.peers}
        self._recvs = {p: self.comm.Irecv([self._bufs[p], MPI.INT], source=p, tag=HEARTBEAT_TAG)
                       for p in self.peers}
        self._thread = threading.Thread(target=self._run, name="ggpipe-liveness", daemon=True)
        self._wake = threading.Event()
        self._peer_signal = False
        self.before_abort: list[Callable[[str], None]] = []  # front ends: answer clients first
        self.fired = False
        self._leaving = False
        if threading.current_thread() is threading.main_thread():
            # hydra (-disable-auto-cleanup) signals a rank's death with SIGUSR1
            signal.signal(signal.SIGUSR1, self._on_sigusr1)

    def _on_sigusr1(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self._peer_signal = True
        self._wake.set()

    def start(self) -> Liveness:
        """Start the heartbeat thread; returns ``self``."""
        self._thread.start()
        return self

    # -- the thread ------------------------------------------------------------

    def _send_all(self, flag: int) -> None:
        for p in self.peers:
            prev = self._sends.get(p)
            if prev is not None and not prev[0].Test():
                continue  # the last one has not left yet (a stopped peer): do not pile up
            beat = np.array([self.rank, flag], dtype=np.int32)
            self._sends[p] = (self.comm.Isend([beat, self.MPI.INT], dest=p, tag=HEARTBEAT_TAG), beat)

    def _receive_all(self) -> None:
        now = time.monotonic()
        for p, req in self._recvs.items():
            while req.Test():
                self.monitor.heard(p, now, leaving=int(self._bufs[p][1]) == _LEAVING)
                req = self.comm.Irecv([self._bufs[p], self.MPI.INT], source=p, tag=HEARTBEAT_TAG)
                self._recvs[p] = req

    def _gone_here(self) -> list[int]:
        """Peers on this host whose process has exited."""
        me = os.uname().nodename
        out = []
        for p in self.peers:
            info = self.peer_info(p)
            if info is not None and info[0] == me and p not in self.monitor.departed \
                    and process_state(info[1]) == "exited":
                out.append(p)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            if self._peer_signal:  # the launcher says a process died: look at once
                self._peer_signal = False
                gone = self._gone_here()
                if gone:
                    self.fired = True
                    self.on_dead(self.message(gone[0], now - self.monitor.last[gone[0]]))
                    return
            self._send_all(0)
            self._receive_all()
            late = self.monitor.overdue(now)
            if late and not self._stop.is_set():
                self.fired = True
                self.on_dead(self.message(*late[0]))
                return

    def message(self, peer: int, silent_s: float) -> str:
        """The one line reporting ``peer`` (silent for ``silent_s`` seconds)."""
        info = self.peer_info(peer)
        how = "stopped answering"
        if info is not None and info[0] == os.uname().nodename:
            state = process_state(info[1])
            how = {"exited": "died (its process is gone)", "stopped": "is stopped (SIGSTOP?)"}.get(state, how)
        who = self.describe(peer)
        me = "" if self.rank == 0 else f"rank {self.rank}: "
        return (f"{me}{who} {how} while the job was {self.activity()} (last heartbeat {silent_s:.1f} s ago, "
                f"--liveness-timeout {self.timeout_s:g}); stopping every rank")

    def _abort(self, line: str, grace_s: float = 1.0) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"ggpipe: error: {line}\n")
        for hook in self.before_abort:  # e.g. the server answers its clients with 503
            try:
                hook(line)
            except Exception:  # noqa: BLE001 - nothing may stop the abort
                pass
        abort_world(self.MPI.COMM_WORLD, 1, grace_s if self.before_abort else 0.5)

    # -- shutting down -----------------------------------------------------------

    def stop(self, leaving: bool = True) -> None:
        """Stop watching; with ``leaving`` tell the peers this rank is going
        away normally (so they do not report it). Heartbeats still arriving
        are received until :meth:`close`."""
        if self._stop.is_set():
            return
        ignore_launcher_signal()  # from here on a peer's exit is normal
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if leaving and not self.fired:
            self._wait_sends(1.0)  # a beat still in flight first: the LEAVING one must not be skipped
            self._send_all(_LEAVING)
        self._leaving = leaving and not self.fired

    def close(self, wait_s: float = 2.0) -> None:
        """Stop (leaving) if not stopped, then receive the peers' heartbeats
        until every peer has said it is leaving (at most ``wait_s`` seconds),
        and release the requests. A heartbeat left unreceived at
        ``MPI_Finalize`` is an unmatched message: UCX prints a warning for
        each on stdout ("unexpected tag-receive descriptor ... was not
        matched"), seen between hosts (scripts/netns_cluster.py). MPI keeps
        the order of one sender's messages on a communicator, so a peer's
        LEAVING beat is its last."""
        self.stop(leaving=True)
        if self._leaving:
            deadline = time.monotonic() + wait_s
            while set(self.peers) - self.monitor.departed and time.monotonic() < deadline:
                self._receive_all()
                time.sleep(1e-3)
        for req in self._recvs.values():
            try:
                req.Cancel()
                req.Wait()
            except self.MPI.Exception:
                pass
        self._recvs = {}
        self._wait_sends(1.0)

    def _wait_sends(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        for req, _ in self._sends.values():
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
