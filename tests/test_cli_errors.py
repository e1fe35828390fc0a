"""Bad input gives one clear line on stderr and a non-zero exit, never a hang
or a traceback — under real MPI ranks where the error involves them."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.hydra, pytest.mark.full]  # hydra: finds ranks by PMI_RANK



# The bad-input cases (missing/truncated/non-GGUF files, splits, context, draft
# vocabulary, ...) are the table in docs/ERRORS.md, run by test_bad_input_table.py.


@pytest.mark.mpi
def test_ranks_started_with_different_arguments(smollm2):
    import subprocess
    import sys

    from conftest import ROOT, mpiexec

    base = [sys.executable, "-m", "ggpipe", "generate", "-m", str(smollm2), "-p", "hi"]
    cmd = [mpiexec(), "-n", "1", *base, "-n", "4", ":", "-n", "1", *base, "-n", "5"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0
    assert "rank 1" in p.stderr and "different arguments" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.mpi
def test_stopped_rank_is_reported_by_name_within_the_timeout(smollm2):
    """A rank that stops answering (SIGSTOP) during generation is reported
    within --timeout, naming it; the job ends with a non-zero code and leaves
    no process behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from conftest import ROOT, mpiexec, wait_for_ranks

    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "ggpipe", "generate", "-m", str(smollm2),
           "-p", "Once upon a time", "-n", "1500", "--ignore-eos", "--timeout", "3"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert p.stdout.read(1)  # the head has started streaming tokens
        procs = wait_for_ranks(p.pid, 2)
        assert 1 in procs, "rank 1 not found"
        pids = [procs[1].pid]
        children = psutil.Process(p.pid).children(recursive=True)
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        _, err = p.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert "rank 1" in err and "waited" in err, err
    assert "Traceback" not in err
    assert elapsed < 10 + 3
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
