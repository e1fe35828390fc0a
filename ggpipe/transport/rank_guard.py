"""The rank guard: a small parent process that outlives its rank, so a rank
that dies is named whatever the launcher does to the others next.

Under an MPI launcher the ``ggpipe`` entry point calls :func:`start` first
thing. It forks: the child is the rank (it starts MPI, loads its stage and
serves); the parent, the process the launcher started and watches, only
waits for it. When the rank dies of a signal that the guard did not pass on
to it (``kill -9``, the kernel's OOM killer, a crash inside llama.cpp), the
guard writes one line to stderr naming the rank, its host, its pid, its
layers and what it was doing (a page of shared memory the rank keeps up to
date: :func:`set_role`, :func:`set_doing`), and then dies of the same signal,
so the launcher sees what it would have seen and ends the job its own way.

Why a parent: MPICH's hydra, with its default flags, kills every other
process of a job the instant one of them ends, before any surviving rank can
say which one it was; Open MPI's ``prterun`` does the same. The guard learns
of its child's death (``waitpid``) before the launcher learns of anything.

* Signals the guard gets (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1,
  SIGUSR2: Ctrl-C, ``scancel``, hydra's SIGUSR1) are passed on to the rank,
  which handles them as before; a rank that then dies of one of them is not
  reported as a failure. The rank has a process group of its own, so a
  signal a launcher sends to the guard's group reaches it once.
* The rank dies with its guard (``PR_SET_PDEATHSIG``): a guard killed by the
  launcher's clean-up leaves nothing running.
* Exit codes pass through unchanged.
* A rank that crashes (SIGSEGV, SIGABRT, ...) is reported after
  :data:`CRASH_GRACE_S`: a crash can be MPI's reaction to a peer that was
  killed, and the launcher, which ends the job at the first report, would
  then drop the killed peer's own line on its host. If the launcher ends
  this guard meanwhile, it stays quiet.
* ``GGPIPE_GUARD=0`` turns it off (then a rank is one process, as before).

Each rank is then two processes with the same command line and environment:
the guard, named ``ggpipe-guard`` in ``ps``/``top``, and its child that holds
the stage (the one to look at with ``top`` or a debugger). Kept free of heavy imports: the entry point runs it
before anything else.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_FIELD = 1024          # bytes per status field in the shared page
_ROLE, _DOING, _REPORTED = 0, _FIELD, 2 * _FIELD
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15
GUARD_NAME = "ggpipe-guard"   # the guard's process name (/proc/PID/comm)

_page: mmap.mmap | None = None
_launcher_pid = 0
_held: list = []  # a claim's socket, when no sleep could be started to hold it (_claim)
CLAIM_NAME = "ggpipe-report-claim"  # argv[0] of the short sleep that holds a job's report claim (_claim)
GUARD_GONE = signal.SIGRTMIN + 2  # the rank's parent-death signal: its guard ended before it


def enabled() -> bool:
    """``GGPIPE_GUARD`` is not "0"."""
    return os.environ.get("GGPIPE_GUARD", "1") != "0"


def start(rank: int) -> None:
    """Fork the rank off its guard. Returns in the child (the rank); the
    parent becomes the guard and never returns (it exits as its child did).
    Call before any thread is started and before MPI is initialised."""
    global _page, _launcher_pid
    page = mmap.mmap(-1, 3 * _FIELD)  # anonymous and shared: written by the rank, read by its guard
    # written before the fork: a rank killed the instant it exists is still named "while starting"
    _put(page, _DOING, "starting (before MPI start-up)")
    guard_pid = os.getpid()
    _launcher_pid = os.getppid()  # the launcher's process on this host (hydra's proxy, Open MPI's prted)
    name = _comm()
    # named before the fork, so that no one listing processes ever sees the guard under the rank's name
    _prctl(_PR_SET_NAME, ctypes.c_char_p(GUARD_NAME.encode()))
    # none may be lost between the fork and the guard's sigtimedwait (the rank unblocks them)
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid < 0:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return  # no guard: the rank runs as one process
    if pid == 0:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name))
        _page = page
        _die_with(guard_pid, rank)
        try:
            # a process group of its own: a launcher that signals the guard's group (hydra does)
            # reaches the rank once, through the guard, not twice (a second SIGTERM would cut
            # a server's shutdown grace short)
            os.setpgid(0, 0)
        except OSError:
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return
    _guard(rank, pid, page)


def set_role(text: str) -> None:
    """The rank's part of the job, e.g. "target layers 20-39" (no-op
    without a guard)."""
    _write(_ROLE, text)


def set_doing(text: str) -> None:
    """What the rank is doing now, e.g. "decoding run 57 (4 tokens)" (no-op
    without a guard; a few microseconds with one)."""
    _write(_DOING, text)


def mark_reported() -> None:
    """ggpipe has already printed why this rank ends (a time-out, a dead
    peer) and is about to kill it or abort the job: the guard stays quiet
    if the rank then dies of a signal."""
    if _page is not None:
        _page[_REPORTED] = 1
        _claim()


def _write(offset: int, text: str) -> None:
    if _page is not None:
        _put(_page, offset, text)


def _put(page: mmap.mmap, offset: int, text: str) -> None:
    b = text.encode("utf-8", "replace")[: _FIELD - 1] + b"\0"
    page[offset:offset + len(b)] = b


def _read(page: mmap.mmap, offset: int) -> str:
    raw = page[offset:offset + _FIELD]
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _claim(hold_s: float = 1.5) -> bool:
    """Claim this host's one report of why the job ends: True for the first
    process of the job on this host (network namespace) to ask within
    ``hold_s`` seconds, False for the others.

    The claim is an abstract Unix socket name (Linux: nothing on disk, gone
    with its last descriptor) held ``hold_s`` seconds by a ``sleep`` of its
    own session, shown as :data:`CLAIM_NAME` by ``ps``, so it outlives the
    process that claimed it: a launcher takes the job's other processes down
    right after the first one ends,
    and their ranks (see :func:`_die_with`) must then stay quiet. The name
    is the launcher's pid on this host (one per job), or ``GGPIPE_JOB_KEY``
    where one process starts several jobs' guards (the tests)."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    except OSError:
        return True
    try:
        sock.bind(f"\0ggpipe-job-report-{os.environ.get('GGPIPE_JOB_KEY') or _launcher_pid}")
    except OSError:
        sock.close()
        return False
    try:
        import shutil  # noqa: PLC0415 (only when a job ends: the guard stays light)
        import subprocess  # noqa: PLC0415

        subprocess.Popen([CLAIM_NAME, str(hold_s)], executable=shutil.which("sleep") or "/bin/sleep",
                         pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        sock.close()
    except OSError:
        _held.append(sock)  # no sleep: this process holds it for as long as it lives
    return True


def _die_with(guard_pid: int, rank: int) -> None:
    """In the child: get :data:`GUARD_GONE` when the guard dies (Linux;
    elsewhere the launcher's own clean-up has to do), then end, saying so in
    one line if this is the first process of the job on this host to end (a
    guard killed by hand: ``kill -9`` of the process the launcher started;
    the launcher then ends the job); exit at once if the guard is gone already.
    The line is written by a Python signal handler, so a rank inside a long
    C call (a prompt chunk's ``llama_decode``) ends when that call returns."""
    def gone(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
        if not _page[_REPORTED] and _claim():
            os.write(2, (guard_gone_line(rank, socket.gethostname(), os.getpid(), guard_pid,
                                         _read(_page, _ROLE), _read(_page, _DOING)) + "\n").encode("utf-8", "replace"))
        os._exit(128 + int(signal.SIGKILL))

    signal.signal(GUARD_GONE, gone)
    _prctl(_PR_SET_PDEATHSIG, int(GUARD_GONE))
    if os.getppid() != guard_pid:
        os._exit(1)


def guard_gone_line(rank: int, host: str, pid: int, guard_pid: int, role: str, doing: str) -> str:
    """The rank's one line when its guard (the process the launcher started
    for it) ended first, e.g. ``ggpipe: error: rank 1 (node2, pid 4243,
    target layers 20-39): its guard process (pid 4242, the one the launcher
    started for this rank) was killed while the rank was decoding run 57,
    by hand or by the launcher ending the job after another of its
    processes ended; the rank ends with it``."""
    who = "the head, rank 0" if rank == 0 else f"rank {rank}"
    return (f"ggpipe: error: {who} ({host}, pid {pid}{', ' + role if role else ''}): its guard process (pid "
            f"{guard_pid}, the one the launcher started for this rank) was killed"
            f"{' while the rank was ' + doing if doing else ''}, by hand or by the launcher ending the job after "
            f"another of its processes ended; the rank ends with it")


def _prctl(option: int, *args) -> None:
    """prctl(2) through the C library already loaded in this process
    (``CDLL(None)``): ``ctypes.util.find_library`` runs ``ldconfig`` as a child
    process, which between the fork and the rank's rename would be a child of
    a process named :data:`GUARD_NAME` with the rank's environment."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, *args, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux


def _comm() -> bytes:
    """This process's name (/proc/self/comm), e.g. b"python3"."""
    try:
        with open("/proc/self/comm", "rb") as f:
            return f.read().strip()[:15]
    except OSError:
        return b"python"


def _guard(rank: int, child: int, page: mmap.mmap) -> None:
    passed_on: set[int] = set()
    # signals are taken synchronously (sigtimedwait) with FORWARDED blocked since before the fork: a Python
    # handler can be lost for as long as the rank lives, when its signal lands after the last check for
    # pending handlers and before waitpid blocks (seen on a loaded machine: a SIGTERM never passed on)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    while True:
        try:
            done, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            os._exit(1)
        if done:
            break
        info = signal.sigtimedwait((*FORWARDED, signal.SIGCHLD), 1.0)  # the time-out bounds a missed SIGCHLD
        if info is not None and info.si_signo in FORWARDED:
            passed_on.add(info.si_signo)
            try:
                os.kill(child, info.si_signo)
            except ProcessLookupError:
                pass
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    report = sig not in passed_on and not page[_REPORTED]
    if report and sig in CRASH_SIGNALS:
        # a crash may follow a peer's death (MPI's progress engine on a reset connection): that peer's
        # guard reports at once, and the launcher then ends this one (a forwarded signal, or SIGKILL);
        # a crash after a signal was passed on happened while the job was being ended anyway
        report = not passed_on and signal.sigtimedwait(FORWARDED, CRASH_GRACE_S) is None
    if report and _claim():
        os.write(2, (death_line(rank, socket.gethostname(), child, sig, _read(page, _ROLE), _read(page, _DOING))
                     + "\n").encode("utf-8", "replace"))
    try:
        signal.signal(sig, signal.SIG_DFL)   # it may have been inherited as ignored
    except (OSError, ValueError):
        pass  # SIGKILL, SIGSTOP: their action cannot be changed, and is the default
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
    sys.stderr.flush()
    os.kill(os.getpid(), sig)   # die as the rank died, so the launcher reports what it always has
    os._exit(128 + sig)


def death_line(rank: int, host: str, pid: int, sig: int, role: str, doing: str) -> str:
    """The guard's one line, e.g. ``ggpipe: error: rank 1 (node2, pid 4242,
    target layers 20-39) died (killed by SIGKILL) while decoding run 57 (4
    tokens); the job stops``."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    who = "the head, rank 0" if rank == 0 else f"rank {rank}"
    crash = (" (a crash inside llama.cpp: where its kernels crash on these weights, run with --no-repack for its "
             "plain kernels)" if sig in CRASH_SIGNALS and doing.startswith("decoding") else "")
    return (f"ggpipe: error: {who} ({host}, pid {pid}{', ' + role if role else ''}) died (killed by {name})"
            f"{' while ' + doing if doing else ''}; the job stops{crash}")


#: Signals of a crash in native code (not a kill): the guard's line then names --no-repack.
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
#: Seconds a guard whose rank crashed waits before it reports: a rank killed on another host can make
#: MPI crash in its peers (hydra's proxies then lose the killed rank's own line when the first report
#: ends the job); the killed rank's guard reports at once, and the launcher ends this guard meanwhile.
CRASH_GRACE_S = 1.0


RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # MPICH/hydra, Open MPI, PMIx launchers


def rank_processes(root_pid: int) -> dict:
    """The processes holding the ranks' stages under ``root_pid`` (a
    launcher), by rank, under any launcher (psutil.Process values): the
    children of the ranks' guards, never a guard itself, a process not yet
    forked off its guard, nor the watchdog a rank forks around MPI_Init
    (its parent is the rank). For tests and scripts that watch or signal a
    job's ranks by pid. Empty when ``root_pid`` is gone."""
    import psutil  # noqa: PLC0415 (the guard itself stays light)

    found = {}
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return found
    for c in children:
        try:
            env = c.environ()
            r = next((env[k] for k in RANK_VARS if k in env), None)
            parent = c.parent()
            # the rank has its guard's command line; a helper program it runs does not
            if r is None or parent is None or parent.name() != GUARD_NAME or c.cmdline() != parent.cmdline():
                continue
        except psutil.Error:
            continue
        found[int(r)] = c
    return found
