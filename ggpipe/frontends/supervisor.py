"""The supervisor of a job that survives a lost rank: ``ggpipe batch --ranks
N ...`` run without ``mpiexec``.

The command then starts the MPI launcher itself (``mpiexec -n N [-f
hostfile]`` and this ggpipe's ``batch ...``, the same command without
``--ranks``/``--hostfile``) and stays outside the MPI job, on the head's
host. The requests' state lives outside the job too: the input file and the
output file, where every finished request's record is written and fsync'd
at once. When the job ends because a rank was lost (the one line its guard
or the head's heartbeats print, :func:`ggpipe.cluster.recovery.parse_loss`),
the supervisor says so in one line and starts the job again; the new job
plans its layer split over the ranks it has (the same rules as the first),
skips the requests already written and runs the others, those that were in
flight included, from their prompts. Where a host keeps losing ranks
without progress it is left out (:class:`ggpipe.cluster.recovery.RecoveryPolicy`).

A job that ends for any other reason (done, a bad input, Ctrl-C) ends the
command with the job's exit code, as without a supervisor. Why not ULFM
(``MPIX_Comm_shrink``): neither MPI wheel on PyPI survives a peer's death
in practice (MPICH 5.0's ch4 aborts at start-up with fault tolerance on;
Open MPI 5.0's ``--with-ft ulfm`` hangs on the first failure), and a launcher
ends the whole job at a rank's death by default anyway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ggpipe.child_process import child_env, ggpipe_command
from ggpipe.cluster.plan import detect_flavor
from ggpipe.cluster.recovery import READY_ENV, Loss, RecoveryPolicy, parse_loss, read_ready
from ggpipe.errors import ConfigError
from ggpipe.transport.launcher_path import find_launcher

#: The options of the supervisor itself, left out of the job's command line (each takes a value).
SUPERVISOR_OPTIONS = ("--ranks", "--hostfile", "--mpiexec")


def job_argv(argv: list[str], also: tuple[str, ...] = ()) -> list[str]:
    """``argv`` (a command's arguments) without :data:`SUPERVISOR_OPTIONS`,
    the options ``also`` names, and their values (``--ranks 3`` or
    ``--ranks=3``)."""
    drop = SUPERVISOR_OPTIONS + also
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif not any(a.startswith(o + "=") for o in drop):
            out.append(a)
    return out


def launch_command(flavor: str, n_ranks: int, hostfile: str | None, env: tuple[str, ...] = ()) -> list[str]:
    """The launcher's part of a supervised job's command line: ``mpiexec -n
    N``, with a hostfile one rank per host in turn (Open MPI ``--hostfile F
    --map-by node``, Hydra ``-f F -ppn 1``), passing the variables ``env``
    (names) besides the ready file's. The launcher's default clean-up is
    kept: it ends the job at once when a rank dies, after the rank's guard
    has named it."""
    cmd = ["mpiexec", "-n", str(n_ranks)]
    if hostfile is not None:
        cmd += ["--hostfile", hostfile, "--map-by", "node"] if flavor == "openmpi" else ["-f", hostfile, "-ppn", "1"]
    if flavor == "openmpi":
        for name in (READY_ENV, *env):
            cmd += ["-x", name]   # Open MPI passes only the variables it is told to
    return cmd


def write_hostfile(path: Path, hosts: list[tuple[str, int]], flavor: str) -> None:
    """``hosts`` as the launcher reads them (``host slots=N`` for Open MPI,
    ``host:N`` otherwise)."""
    lines = [f"{h} slots={n}" if flavor == "openmpi" else f"{h}:{n}" for h, n in hosts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


class JobWatch:
    """What a supervised command does around its jobs; the defaults suit
    ``batch`` (its results file is the state that outlives a job)."""

    #: The job's stdout comes through :meth:`stdout_line` (else it is the command's own).
    pipe_stdout = False

    def stdout_line(self, line: str) -> None:
        """A line of the job's stdout (with ``pipe_stdout``)."""
        sys.stdout.write(line)
        sys.stdout.flush()

    def lost(self, loss: Loss) -> None:
        """The job lost a rank (called on the thread that reads the job's
        stderr, the moment its line arrives)."""

    def progress(self) -> int:
        """A number that grows while the jobs do their work."""
        return 0

    def ended(self, reason: str) -> None:
        """The command ends: no job will run again (``reason``, one line)."""

    def stopping(self) -> None:
        """The command was asked to stop (SIGINT/SIGTERM, passed on to the
        job): what the job answers as it stops is the answer (called from
        the signal handler)."""


class Supervisor:
    """Runs a job under the MPI launcher until it ends other than by a lost rank.

    Args:
        argv: the job's command (``["batch", "in.jsonl", "-o", "out.jsonl", ...]``).
        policy: where each job runs (ranks, hosts, hosts left out).
        watch: what the command does around its jobs (:class:`JobWatch`).
        poll_s: how often the job's state is looked at (seconds).
        mpiexec: the MPI launcher (a name on ``PATH`` or beside this
            Python, or a path).
        env: variables every job's ranks get (name -> value).

    Raises:
        ConfigError: no such launcher.
    """

    def __init__(self, argv: list[str], policy: RecoveryPolicy, watch: JobWatch | None = None, poll_s: float = 0.1,
                 mpiexec: str = "mpiexec", env: dict[str, str] | None = None):
        self.argv, self.policy, self.watch, self.poll_s = argv, policy, watch or JobWatch(), poll_s
        self.env = dict(env or {})    # variables every job gets
        self.mpiexec = find_launcher(mpiexec)   # PATH, else beside this Python
        self.signal: int | None = None
        self.proc: subprocess.Popen | None = None
        self.first_start_s: float | None = None   # the first job's start-up and load (seconds)
        self.loss_named_at: float | None = None   # when the running job's lost rank was named (monotonic)
        self.flavor = "unknown"

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        """SIGINT/SIGTERM: pass it on to the launcher (which passes it on to
        the ranks: a first one stops the job as under ``mpiexec``, a second
        one at once), and start no other job."""
        self.signal = signum
        self.watch.stopping()
        self._pass_signal()

    def _pass_signal(self) -> None:
        if self.signal is None or self.proc is None or self.proc.poll() is not None:
            return
        target = self.proc
        if self.flavor == "openmpi":
            # Open MPI's launcher ends the ranks on SIGINT/SIGTERM instead of passing it on: the head's
            # process gets it, and ends the job as it does under mpiexec (a server's grace included)
            from ggpipe.transport.rank_guard import rank_processes

            target = rank_processes(self.proc.pid).get(0) or self.proc
        try:
            target.send_signal(self.signal)
        except Exception:  # noqa: BLE001 - gone meanwhile (ProcessLookupError, psutil.NoSuchProcess): nothing to stop
            pass

    #: A job started again after a loss that is not ready after this many times the first job's start-up
    #: (and at least MIN_RESTART_S seconds) is ended and counts as a failed start on the lost rank's host.
    RESTART_FACTOR = 4
    MIN_RESTART_S = 60.0

    #: Seconds the launcher may take to end the job after a lost rank was named, before the supervisor ends
    #: it (SIGKILL: the job is lost; what its ranks would still do gracefully waits for the dead rank).
    #: Hydra across hosts sometimes waits until the head's heartbeats time out (--liveness-timeout), and
    #: Open MPI's prterun for its daemon on a host it can no longer reach.
    LINGER_S = 1.0

    def restart_timeout_s(self) -> float:
        """Seconds a job started again after a loss may take to be ready."""
        return max(self.MIN_RESTART_S, self.RESTART_FACTOR * (self.first_start_s or self.MIN_RESTART_S))

    def _signal_job(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)   # the launcher's process group (its own: process_group=0)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_job(self) -> None:
        """SIGKILL to the launcher and every process it started on this host
        (Hydra's proxy, the ranks' guards and the ranks each have a session
        or process group of their own, so the launcher's group alone would
        leave them running, an old head still writing beside the new job);
        the ranks on other hosts end with their launcher's processes there,
        or when their heartbeats time out."""
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            procs = []
        self._signal_job(signal.SIGKILL)
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass

    def run(self) -> int:
        """Run jobs until one ends other than by a lost rank; returns the
        last job's exit code, or 1 when nowhere is left to run."""
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)
        self.flavor = detect_flavor(self.mpiexec)
        with tempfile.TemporaryDirectory(prefix="ggpipe-supervisor-") as tmp:
            lost_at = None
            while True:
                code, loss, ready, progressed = self._job(Path(tmp), lost_at)
                if code == 0 or self.signal is not None:
                    self.watch.ended("the server stopped" if code == 0 else "interrupted")
                    return code
                if loss is None and (lost_at is None or ready):
                    self.watch.ended(f"the job ended with exit code {code}")
                    return code   # not a lost rank: the job's own line said why
                if lost_at is None or ready:   # a new loss (not a start again that failed): from when it was named
                    lost_at = self.loss_named_at if self.loss_named_at is not None else time.monotonic()
                left_out = list(self.policy.excluded)
                reason = self.policy.lost(loss, progressed)
                what = (f"{'the head, ' if loss.rank == 0 else ''}rank {loss.rank} ({loss.host}) was lost"
                        if loss is not None else
                        f"the job could not start again on {self.policy.last_host}")
                if reason is not None:
                    sys.stderr.write(f"ggpipe: error: {what}; {reason}: the job stops\n")
                    self.watch.ended(f"{what}; {reason}")
                    return code or 1
                gone = [h for h in self.policy.excluded if h not in left_out]
                hosts = sorted(set(self.policy.placed()), key=self.policy.placed().index)
                sys.stderr.write(f"ggpipe: {what}; "
                                 + (f"leaving host {gone[0]} out (it lost a rank in {self.policy.exclude_after} "
                                    f"jobs in a row without progress); " if gone else "")
                                 + f"starting the job again on {self.policy.n_ranks} rank"
                                 f"{'s' if self.policy.n_ranks != 1 else ''} ({', '.join(hosts)}); "
                                 f"the requests in flight go on in the new job\n")
                sys.stderr.flush()

    def _job(self, tmp: Path, lost_at: float | None) -> tuple[int, Loss | None, bool, bool]:
        """One job: (exit code, the rank it lost or None, whether it became
        ready, whether it made progress)."""
        hostfile = None
        if self.policy.hosts is not None:
            hostfile = tmp / "hosts"
            write_hostfile(hostfile, self.policy.hosts, self.flavor)
        ready_path = tmp / "ready.json"
        ready_path.unlink(missing_ok=True)
        env = child_env(dict(os.environ, **self.env, **{READY_ENV: str(ready_path)}))
        cmd = launch_command(self.flavor, self.policy.n_ranks, str(hostfile) if hostfile else None, tuple(self.env)) \
            + [*ggpipe_command(), *self.argv]
        cmd[0] = self.mpiexec
        # the launcher gets SIGTERM when this process ends (PR_SET_PDEATHSIG, kept across its exec): a job
        # never outlives its supervisor
        cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        start, before = time.monotonic(), self.watch.progress()
        try:
            # a process group of its own: Ctrl-C reaches the supervisor, which passes it on
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                         stdout=subprocess.PIPE if self.watch.pipe_stdout else None,
                                         process_group=0)
        except OSError as e:
            raise ConfigError(f"cannot start {self.mpiexec}: {e.strerror or e}") from None
        self._pass_signal()   # one that came while the job started
        losses: list[Loss] = []
        readers = [threading.Thread(target=_pass_on, args=(self.proc.stderr, losses, self.watch.lost), daemon=True)]
        if self.watch.pipe_stdout:
            readers.append(threading.Thread(target=_lines, args=(self.proc.stdout, self.watch.stdout_line),
                                            daemon=True))
        for t in readers:
            t.start()
        ready, ended_at = False, None
        self.loss_named_at = None
        while self.proc.poll() is None:
            now = time.monotonic()
            if self.loss_named_at is None and losses:
                self.loss_named_at = now
            if self.loss_named_at is not None and ended_at is None and now - self.loss_named_at > self.LINGER_S:
                sys.stderr.write(f"ggpipe: the launcher has not ended {self.LINGER_S:g} s after the loss; "
                                 f"ending it\n")
                ended_at = now
                self._kill_job()
            elif lost_at is not None and not ready and ended_at is None and now - start > self.restart_timeout_s():
                first = "" if self.first_start_s is None else f" (the first loaded in {self.first_start_s:.1f} s)"
                sys.stderr.write(f"ggpipe: the job started again after the loss is not ready after "
                                 f"{now - start:.0f} s{first}; ending it\n")
                ended_at = now
                self._signal_job(signal.SIGTERM)
            elif ended_at is not None and now - ended_at > 10:
                self._kill_job()
            stages = None if ready else read_ready(ready_path)
            if stages is not None:
                ready = True
                if self.first_start_s is None:
                    self.first_start_s = now - start
                if lost_at is not None:
                    sys.stderr.write(f"ggpipe: back {now - lost_at:.1f} s after the loss (start-up and load "
                                     f"{now - start:.1f} s): {'; '.join(stages)}\n")
                    sys.stderr.flush()
            time.sleep(self.poll_s)
        for t in readers:
            t.join(timeout=5.0)
        rc = self.proc.returncode   # a launcher ended by a signal: 128 + the signal, as a shell reports it
        return rc if rc >= 0 else 128 - rc, (losses[0] if losses else None), ready, self.watch.progress() > before


_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def _pass_on(stream, losses: list[Loss], lost: Callable[[Loss], None]) -> None:
    """Copy the job's stderr to ours as it comes (progress bars included),
    and note every lost rank its lines name (``lost`` hears of the first)."""
    out = sys.stderr.buffer
    pending = b""
    while True:
        chunk = stream.read1(65536)
        if not chunk:
            break
        out.write(chunk)
        out.flush()
        pending += chunk
        *lines, pending = pending.replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            loss = parse_loss(line.decode("utf-8", "replace"))
            if loss is not None:
                losses.append(loss)
                if len(losses) == 1:
                    lost(loss)
        pending = pending[-4096:]


def _lines(stream, handle: Callable[[str], None]) -> None:
    """Each line of the job's stdout to ``handle``."""
    for raw in iter(stream.readline, b""):
        handle(raw.decode("utf-8", "replace"))


def results_watch(output: Path) -> JobWatch:
    """The watch of a supervised ``batch``: its progress is the size of its
    results file (bytes)."""

    class Results(JobWatch):
        def progress(self) -> int:
            try:
                return output.stat().st_size
            except OSError:
                return 0

    return Results()


def supervise(argv: list[str], n_ranks: int, hostfile: str | None, watch: JobWatch, mpiexec: str = "mpiexec") -> int:
    """Run the command ``argv`` (``batch ... --ranks N``) without the
    supervisor's options under a :class:`Supervisor`; returns the exit code.

    Raises:
        ConfigError: a hostfile that cannot be read, a launcher that cannot
            be started.
    """
    from ggpipe.cluster.plan import parse_hostfile

    hosts = parse_hostfile(hostfile) if hostfile is not None else None
    return Supervisor(job_argv(argv), RecoveryPolicy(n_ranks, hosts), watch, mpiexec=mpiexec).run()
