"""What holds under any MPI launcher (MPICH's hydra with its default flags or
the scripts' ``-disable-auto-cleanup``, Open MPI's prte): a rank killed at
start-up, mid-generation or while idle is named in one line by its guard
within 10 s, the whole job ends non-zero, and nothing is left running.
(tests/test_dead_and_stuck_ranks.py checks what the surviving ranks add
under hydra with -disable-auto-cleanup.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import MPI_FLAVOR, ROOT, end_job, guard_line, kill_and_wait, mpiexec, wait_for_ranks

pytestmark = pytest.mark.full

FLAGS = [pytest.param((), id="default-flags"),
         pytest.param(("-disable-auto-cleanup",), id="disable-auto-cleanup", marks=pytest.mark.hydra)]


@pytest.mark.mpi
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("phase", ["start-up", "generating", "idle-chat"])
def test_a_killed_rank_is_named_and_ends_the_job_leaving_nothing_running(goliath, flags, phase):
    """kill -9 of rank 1's process (the one holding its stage), at start-up,
    mid-generation or while a chat waits for the user: whatever the launcher
    then does to the other ranks, rank 1's guard (ggpipe/transport/rank_guard.py)
    names it within 10 s; the job ends non-zero; nothing is left running."""
    if phase == "idle-chat":
        args = ["chat", "-m", str(goliath), "-n", "8"]
    else:
        args = ["generate", "-m", str(goliath), "-p", "Tell me a long story.", "-n", "4000", "-c", "4096",
                "--ignore-eos"]
    cmd = [mpiexec(), *flags, "-n", "3", sys.executable, "-m", "ggpipe", *args]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    procs: dict[int, psutil.Process] = {}
    everything: list[psutil.Process] = []
    try:
        procs = wait_for_ranks(p.pid, 3)
        assert sorted(procs) == [0, 1, 2], (MPI_FLAVOR, sorted(procs))
        if phase == "generating":
            assert p.stdout.read(1)
        elif phase == "idle-chat":
            p.stdin.write("/stats\n")
            p.stdin.flush()
            assert p.stdout.readline()  # answered: the ranks are up, and now wait for the next line
            time.sleep(0.5)
        everything = psutil.Process(p.pid).children(recursive=True)
        victim = procs[1]
        out, err, took = kill_and_wait(p, victim)
        assert p.returncode != 0, err[-2000:]
        line = guard_line(err, 1, victim.pid)
        assert line, (MPI_FLAVOR, err[-2000:])
        if phase != "start-up":
            assert "target layers" in line.group(0), line.group(0)
        assert took < 10, (took, err[-2000:])
        time.sleep(1)
        alive = [c.pid for c in everything if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, (MPI_FLAVOR, alive, err[-2000:])
    finally:  # nothing of the job outlives the test, whatever failed
        end_job(p, [*procs.values(), *everything])
