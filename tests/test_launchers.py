"""What holds under any MPI launcher (MPICH's hydra or Open MPI's prte): a
rank killed mid-generation ends the whole job, non-zero, with nothing left
running. (Naming the dead rank is what tests/test_reliability.py checks under
hydra with -disable-auto-cleanup; under a launcher that kills the survivors
at once the launcher's own banner is all there is.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import MPI_FLAVOR, ROOT, mpiexec

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def rank_procs(launcher_pid: int, n: int, timeout: float = 60) -> dict[int, psutil.Process]:
    """The python rank processes under the launcher, by rank (any launcher)."""
    found: dict[int, psutil.Process] = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end and len(found) < n:
        for c in psutil.Process(launcher_pid).children(recursive=True):
            try:
                env = c.environ()
                if "python" not in c.name():
                    continue
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            r = next((env[k] for k in RANK_VARS if k in env), None)
            if r is not None:
                found[int(r)] = c
        time.sleep(0.05)
    return found


@pytest.mark.mpi
def test_a_killed_rank_ends_the_job_and_leaves_nothing_running(goliath):
    cmd = [mpiexec(), "-n", "3", sys.executable, "-m", "ggpipe", "generate", "-m", str(goliath), "-p",
           "Tell me a long story.", "-n", "4000", "-c", "4096", "--ignore-eos"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    procs: dict[int, psutil.Process] = {}
    try:
        procs = rank_procs(p.pid, 3)
        assert sorted(procs) == [0, 1, 2], (MPI_FLAVOR, sorted(procs))
        assert p.stdout.read(1)  # generating
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        out, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 30 and p.returncode != 0, err[-2000:]
        time.sleep(1)
        alive = [r for r, c in procs.items() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, (MPI_FLAVOR, alive, err[-2000:])
    finally:  # nothing of the job outlives the test, whatever failed (hydra gives each rank its own session)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        for c in procs.values():
            with contextlib.suppress(psutil.Error):
                c.kill()
