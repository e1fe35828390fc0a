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


def _generate(smollm2, *extra):
    import sys

    return [sys.executable, "-m", "ggpipe", "generate", "-m", str(smollm2), "-p", "hi", *extra]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,bad_rank", [(2, 0), (2, 1), (3, 1), (3, 2)])
def test_a_usage_error_on_one_rank_exits_2_as_on_every_rank(smollm2, ranks, bad_rank):
    """A usage error on one rank exits 2, as the same error on every rank
    does (not 3: hydra ORs the ranks' codes, the bad rank's 2 and the
    others' 1)."""
    import subprocess

    from conftest import ROOT, mpiexec, stderr_lines

    cmd = [mpiexec()]
    for r in range(ranks):
        cmd += [*([":"] if r else []), "-n", "1", *_generate(smollm2, "-n", "0" if r == bad_rank else "8")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    lines = stderr_lines(p.stderr)
    assert len(lines) == 1 and "0 is not in the range x>=1" in lines[0], p.stderr
    assert p.returncode == 2, p.stderr
    every = subprocess.run([mpiexec(), "-n", str(ranks), *_generate(smollm2, "-n", "0")], capture_output=True,
                           text=True, timeout=120, cwd=ROOT, check=False)
    assert every.returncode == 2 and len(stderr_lines(every.stderr)) == 1, every.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("target", ["mpiexec", "worker"])
def test_ctrl_c_is_one_line(smollm2, target):
    """Ctrl-C (``mpiexec`` forwards SIGINT to every rank): "ggpipe:
    interrupted" from the head only, exit 130 (it was printed once per rank).
    SIGINT to one worker alone still ends the job with one line naming it."""
    import os
    import signal
    import subprocess
    import time

    from conftest import ROOT, mpiexec, stderr_lines, wait_for_ranks

    cmd = [mpiexec(), "-n", "2", *_generate(smollm2, "-n", "3000", "--ignore-eos", "-c", "4096")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        assert p.stdout.read(20), "no tokens streamed"  # generating
        if target == "mpiexec":
            os.kill(p.pid, signal.SIGINT)
        else:
            wait_for_ranks(p.pid, 2)[1].send_signal(signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    lines = stderr_lines(err)
    assert "Traceback" not in err
    if target == "mpiexec":
        assert lines == ["ggpipe: interrupted"] and p.returncode == 130, err
    else:
        assert len(lines) == 1 and lines[0].startswith("ggpipe: error: rank 1 (") and "interrupted" in lines[0], err
        assert p.returncode != 0
    assert took < 30
