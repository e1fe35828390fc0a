"""The rank guard (ggpipe/transport/rank_guard.py), without MPI: a process that
calls ``start`` becomes the guard of a forked child, which plays the rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ggpipe.transport import rank_guard

@pytest.fixture(autouse=True)
def _own_job_key(monkeypatch, request):
    """Each test's guards form a job of their own: their parent is this
    pytest process, which rank_guard would otherwise take for one launcher
    (the host-wide claim of the job's one report, rank_guard._claim)."""
    monkeypatch.setenv("GGPIPE_JOB_KEY", f"pytest-{os.getpid()}-{request.node.name}")


GUARDED = """
import os, signal, sys, time
from ggpipe.transport import rank_guard
rank_guard.start(3)
rank_guard.set_role("target layers 10-19")
rank_guard.set_doing("decoding run 7 (4 tokens at positions 12..)")
{body}
"""


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", GUARDED.format(body=body)], capture_output=True, text=True,
                          timeout=30)


# The rank waits in short sleeps, as a real rank's serve loop waits with time-outs. One long
# time.sleep() can hold a Python signal handler back for its whole length: CPython runs handlers
# between bytecodes, and a signal that lands after the last check but before the sleep's syscall
# starts does not interrupt it. A CI run caught exactly that (the rank had SIGTERM delivered and
# its handler installed, yet slept on), which failed the test though the guard had passed the
# signal on.
WAIT = "for _ in range(600): time.sleep(0.05)"


def _start(setup: str, body: str = WAIT) -> tuple[subprocess.Popen, int]:
    """A guard whose rank runs ``setup``, prints its pid, then runs ``body`` (by default it
    waits about 30 s)."""
    code = GUARDED.format(body=f"{setup}\nprint(os.getpid(), flush=True)\n{body}")
    p = subprocess.Popen([sys.executable, "-c", code],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def test_a_rank_killed_by_a_signal_is_named_by_its_guard():
    p = _run("os.kill(os.getpid(), signal.SIGKILL)")
    assert p.returncode == -signal.SIGKILL  # the guard dies as its rank did: the launcher sees the same
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert re.fullmatch(r"ggpipe: error: rank 3 \([^,]+, pid \d+, target layers 10-19\) died \(killed by SIGKILL\) "
                        r"while decoding run 7 \(4 tokens at positions 12\.\.\); the job stops", lines[0]), lines[0]


def test_a_rank_that_crashes_while_decoding_is_told_the_workaround():
    """A crash in native code (SIGSEGV) while decoding: the line says so and
    names --no-repack (llama.cpp's plain kernels); a kill does not."""
    p = _run("os.kill(os.getpid(), signal.SIGSEGV)")
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "died (killed by SIGSEGV)" in lines[0], p.stderr
    assert lines[0].endswith("run with --no-repack for its plain kernels)")
    assert "--no-repack" not in _run("os.kill(os.getpid(), signal.SIGKILL)").stderr


def test_a_rank_killed_the_instant_it_exists_is_named_while_starting():
    """What the guard says is in place before the fork: an Open MPI CI run once
    killed a rank before its first set_doing, and the line lacked "while"."""
    code = "import os, signal\nfrom ggpipe.transport import rank_guard\nrank_guard.start(1)\nos.kill(os.getpid(), signal.SIGKILL)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert re.fullmatch(r"ggpipe: error: rank 1 \([^,]+, pid \d+\) died \(killed by SIGKILL\) "
                        r"while starting \(before MPI start-up\); the job stops", p.stderr.strip()), p.stderr


def test_a_crash_is_named_too():
    p = _run("os.kill(os.getpid(), signal.SIGSEGV)")
    assert p.returncode == -signal.SIGSEGV
    assert "died (killed by SIGSEGV)" in p.stderr


def _ended_or_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:   # reaped by its guard already
        return True


def test_a_crash_while_the_launcher_ends_the_job_is_not_reported():
    """A rank that crashes because a peer was killed (MPI on a reset
    connection) must not take the report from that peer: its guard waits
    rank_guard.CRASH_GRACE_S, and a launcher that ends it meanwhile (here
    SIGTERM, as hydra's clean-up) finds it quiet. (The grace is 30 s here,
    so that a loaded machine cannot make the SIGTERM come after it.)"""
    code = ("import os, signal, time\nfrom ggpipe.transport import rank_guard\nrank_guard.CRASH_GRACE_S = 30\n"
            "rank_guard.start(3)\nprint(os.getpid(), flush=True)\ntime.sleep(0.3)\nos.kill(os.getpid(), signal.SIGSEGV)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rank_pid = int(p.stdout.readline())
    deadline = time.monotonic() + 10
    while not _ended_or_zombie(rank_pid):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    err = _ended(p, rank_pid)
    assert p.returncode == -signal.SIGSEGV and "died" not in err, err


def test_exit_codes_pass_through_silently():
    for code in (0, 1, 7, 143):
        p = _run(f"sys.exit({code})")
        assert p.returncode == code and p.stderr == ""


def _signal_state(pid: int) -> str:
    """A process's state and signal masks (/proc/PID/status), and where it sleeps."""
    try:
        st = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"pid {pid}: {e}"
    keep = ("State", "Threads", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return f"pid {pid}: " + ", ".join(ln.replace("\t", " ") for ln in st if ln.split(":")[0] in keep) + f", wchan {wchan}"


def _ended(p: subprocess.Popen, rank_pid: int, timeout: float = 10) -> str:
    """The guard's stderr once it has ended; if it has not within ``timeout``,
    fail with both processes' signal state, and end them."""
    try:
        return p.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        state = f"guard {_signal_state(p.pid)}; rank {_signal_state(rank_pid)}"
        for pid in (rank_pid, p.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.communicate()
        pytest.fail(f"the guard did not end within {timeout} s of the signal: {state}")


def test_signals_are_passed_on_to_the_rank_and_not_reported():
    p, rank_pid = _start("signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))")
    assert rank_pid != p.pid
    p.send_signal(signal.SIGTERM)       # to the guard, as mpiexec or scancel would
    err = _ended(p, rank_pid)
    assert p.returncode == 143 and err == ""
    # default action (explicitly: a shell that starts jobs in the background sets some to "ignore"):
    # the rank dies of it, which is no failure
    p, rank_pid = _start("signal.signal(signal.SIGUSR2, signal.SIG_DFL)")
    p.send_signal(signal.SIGUSR2)
    err = _ended(p, rank_pid)
    assert p.returncode == -signal.SIGUSR2 and "died" not in err


def test_quiet_when_ggpipe_already_reported():
    p = _run("rank_guard.mark_reported()\nos.kill(os.getpid(), signal.SIGKILL)")
    assert p.returncode == -signal.SIGKILL and p.stderr == ""


def test_the_rank_dies_with_its_guard_and_the_guard_is_named():
    p, rank_pid = _start("")
    assert psutil.Process(p.pid).name() == rank_guard.GUARD_NAME
    assert psutil.Process(rank_pid).ppid() == p.pid
    p.kill()                            # the launcher's clean-up kills the process it started
    p.wait(timeout=10)
    end = time.monotonic() + 5
    while time.monotonic() < end and psutil.pid_exists(rank_pid):
        try:
            if psutil.Process(rank_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        if psutil.pid_exists(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
            raise AssertionError("the rank outlived its guard")


def test_switch_and_line():
    assert rank_guard.enabled() == (os.environ.get("GGPIPE_GUARD", "1") != "0")
    line = rank_guard.death_line(0, "n1", 42, int(signal.SIGKILL), "", "")
    assert line == "ggpipe: error: the head, rank 0 (n1, pid 42) died (killed by SIGKILL); the job stops"


def test_a_killed_guard_is_named_by_its_rank():
    """kill -9 of the guard (the process the launcher started): the rank,
    which dies with it, says so in one line (not silently)."""
    p, rank_pid = _start("")
    p.kill()
    _, err = p.communicate(timeout=10)
    end = time.monotonic() + 5
    while time.monotonic() < end and psutil.pid_exists(rank_pid):
        time.sleep(0.05)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(rf"ggpipe: error: rank 3 \([^,]+, pid {rank_pid}, target layers 10-19\): its guard process "
                        rf"\(pid {p.pid}, the one the launcher started for this rank\) was killed while the rank was "
                        r"decoding run 7 \(4 tokens at positions 12\.\.\), by hand or by the launcher ending the job "
                        r"after another of its processes ended; the rank ends with it", lines[0]), lines[0]


def test_one_report_per_job_and_host():
    """Once a process of the job has said why it ends (mark_reported, a
    guard's death line), the ranks whose guards the launcher then kills stay
    quiet."""
    first = _run("rank_guard.mark_reported()\nos.kill(os.getpid(), signal.SIGKILL)")
    assert first.stderr == ""
    p, _ = _start("")
    p.kill()
    _, err = p.communicate(timeout=10)
    time.sleep(0.5)
    assert err == ""


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("flags", [[], ["-disable-auto-cleanup"]])
def test_guard_killed_under_mpiexec_one_line(smollm2, flags):
    """The guard of rank 1 killed under hydra, with and without its clean-up."""
    from conftest import ggpipe_cmd, mpiexec

    if "hydra" not in subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout.lower():
        pytest.skip("-disable-auto-cleanup is hydra's (MPICH)")
    cmd = ggpipe_cmd(["generate", "-m", str(smollm2), "-p", "Once upon a time", "-n", "400", "--ignore-eos"], 3)
    cmd = [cmd[0], *flags, *cmd[1:]]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        guard = None
        end = time.monotonic() + 60
        while guard is None and time.monotonic() < end:
            for c in psutil.Process(p.pid).children(recursive=True):
                try:
                    if c.name() == rank_guard.GUARD_NAME and c.environ().get("PMI_RANK") == "1" and c.children():
                        guard = c
                except psutil.Error:
                    pass
            time.sleep(0.1)
        assert guard is not None
        time.sleep(3)
        guard.kill()
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    lines = [ln for ln in err.splitlines() if ln.startswith("ggpipe:")]
    assert len(lines) == 1 and lines[0].startswith("ggpipe: error: rank 1 (") and "its guard process" in lines[0], err


def test_a_program_the_rank_runs_is_never_taken_for_the_rank():
    """rank_processes finds the process holding the stage, never a program it
    runs: here the rank still carries its guard's name (as a freshly forked
    rank does for an instant) and runs ``sleep``, which has the rank's
    environment and a parent named as a guard; only the command line tells
    them apart."""
    setup = ("import ctypes, subprocess\n"
             "ctypes.CDLL(None).prctl(15, ctypes.c_char_p(rank_guard.GUARD_NAME.encode()), 0, 0, 0)\n"
             "helper = subprocess.Popen(['sleep', '30'])")
    code = GUARDED.format(body=f"{setup}\nprint(os.getpid(), helper.pid, flush=True)\n{WAIT}")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PMI_RANK="5"))
    try:
        rank, helper = (int(x) for x in p.stdout.readline().split())
        found = rank_guard.rank_processes(os.getpid())
        assert {r: c.pid for r, c in found.items()} == {5: rank}, (found, helper)
    finally:
        p.kill()
        p.wait(10)
        for pid in (locals().get("rank"), locals().get("helper")):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
