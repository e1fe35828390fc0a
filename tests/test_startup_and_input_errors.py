"""Start-up errors and odd inputs that are not rows of the bad-input table:
start-up errors on one rank under a real launcher, invalid UTF-8, non-finite
option values, a launcher beside the interpreter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import click
import psutil
import pytest

from ggpipe.errors import ConfigError
from ggpipe.cli.types import SECONDS, Finite
from ggpipe.transport.launcher_path import find_launcher
from tests.conftest import ROOT, mpiexec, stderr_lines

PY = [sys.executable, "-m", "ggpipe"]


def _one_error_line(stderr: str) -> str:
    lines = stderr_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("ggpipe: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


# -- pure ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0", "-1"])
def test_seconds_refuse_nan_infinities_and_non_positive(text):
    with pytest.raises(click.BadParameter):
        SECONDS.convert(text, None, None)


def test_finite_keeps_its_range():
    assert Finite(0, 1).convert("0.5", None, None) == 0.5
    for bad in ("nan", "1.5"):
        with pytest.raises(click.BadParameter):
            Finite(0, 1).convert(bad, None, None)


def test_launcher_beside_the_interpreter(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        assert find_launcher() == beside
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ConfigError, match="mpiexec not found on PATH or beside"):
        find_launcher()


# -- one process -----------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--timeout", "0"], "'--timeout': 0.0 is not in the range x>=0.01"),
    (["--timeout", "1e-9"], "'--timeout': 1e-09 is not in the range x>=0.01"),
    (["--timeout", "-1"], "'--timeout'"),
    (["--timeout", "nan"], "'nan' is not a finite number"),
    (["--temp", "nan"], "'--temp': 'nan' is not a finite number"),
    (["--liveness-timeout", "inf"], "not a finite number"),
])
def test_bad_option_values_are_one_line(args, message):
    p = subprocess.run([*PY, "generate", "-p", "hi", "-n", "1", *args], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 2 and message in _one_error_line(p.stderr)


def test_invalid_utf8_prompts_are_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello \xff\xfe world")
    p = subprocess.run([*PY, "generate", "-f", str(bad), "-n", "1"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert p.returncode == 1 and "is not valid UTF-8 (byte 7)" in _one_error_line(p.stderr)
    p = subprocess.run([*[os.fsencode(a) for a in PY], b"generate", b"-p", b"caf\xe9", b"-n", b"1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "the prompt is not valid UTF-8" in _one_error_line(p.stderr)


def test_chat_skips_a_line_that_is_not_utf8(smollm2):
    p = subprocess.run([*PY, "chat", "-m", str(smollm2), "-n", "4"], input=b"caf\xe9\nhi\n/quit\n",
                       capture_output=True, timeout=120, cwd=ROOT)
    out, err = p.stdout.decode(), p.stderr.decode()
    assert p.returncode == 0, err
    assert "[that line is not valid UTF-8 (byte 4); it was not sent]" in out and "Traceback" not in err


# -- real ranks: an error before the ranks have met --------------------------------------


@pytest.mark.mpi
@pytest.mark.full
@pytest.mark.parametrize("bad_rank", [0, 1])
@pytest.mark.parametrize("bad", [["generate", "-n", "0", "-p", "hi"], ["nosuch"], ["generate", "--temp", "nan",
                                                                                      "-p", "hi"]])
def test_an_error_on_one_rank_before_start_up_ends_the_job(smollm2, bad, bad_rank):
    """`mpiexec -n 1 ggpipe generate ... : -n 1 ggpipe generate -n 0 ...` ends
    at once with one line; the other rank does not spin in MPI_Init for ever."""
    good = ["generate", "-m", str(smollm2), "-n", "8", "-p", "hi"]
    parts = [good, bad] if bad_rank == 1 else [bad, good]
    cmd = [mpiexec(), "-n", "1", *PY, *parts[0], ":", "-n", "1", *PY, *parts[1]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert time.monotonic() - t0 < 30
    line = _one_error_line(p.stderr)
    assert p.returncode != 0
    if bad_rank == 1:
        assert line.startswith("ggpipe: error: rank 1 (")


@pytest.mark.mpi
@pytest.mark.full
def test_same_usage_error_on_every_rank_is_one_line():
    p = subprocess.run([mpiexec(), "-n", "3", *PY, "generate", "-p", "hi", "--timeout", "nan"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0 and "'nan' is not a finite number" in _one_error_line(p.stderr)


@pytest.mark.hydra
@pytest.mark.mpi
@pytest.mark.full
def test_a_process_that_never_starts_mpi_ends_the_job(smollm2):
    """A non-ggpipe process in the job: MPI_Init cannot return; the watchdog
    (transport/init_watchdog.py) ends the rank with one ggpipe line."""
    env = dict(os.environ, GGPIPE_INIT_TIMEOUT="3")
    t0 = time.monotonic()
    p = subprocess.run([mpiexec(), "-n", "1", *PY, "generate", "-m", str(smollm2), "-n", "4", "-p", "hi", ":",
                        "-n", "1", "true"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert time.monotonic() - t0 < 30 and p.returncode != 0
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("ggpipe: error: ")]
    assert len(ours) == 1 and "MPI start-up (MPI_Init) did not complete within 3 s" in ours[0], p.stderr
    assert ours[0].startswith("ggpipe: error: rank 0 (")


@pytest.mark.hydra  # hydra's stdin forwarding; under Open MPI this hangs (not investigated)
@pytest.mark.mpi
@pytest.mark.full
def test_a_200kb_chat_line_under_mpiexec(smollm2, tmp_path):
    """hydra forwards stdin without back-pressure and ended the job ("reading
    stdin too slowly", exit 141) when a long line did not fit the pipe while
    the head was busy; the head now drains stdin on a thread. A file given
    at start goes through -i (hydra can overrun before any rank runs)."""
    big = ("word " * 40000 + "\n").encode() + b"hi\n"
    cmd = [mpiexec(), "-n", "2", *PY, "chat", "-m", str(smollm2), "-n", "4"]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         start_new_session=True)
    try:
        time.sleep(4)  # a paste while the head loads the model or waits for a turn
        out, err = p.communicate(big, timeout=120)
    finally:  # a hung job must not outlive the test (its ranks would spin on the cores of later runs)
        if p.poll() is None:
            ranks = psutil.Process(p.pid).children(recursive=True)  # hydra puts each rank in its own session
            os.killpg(p.pid, signal.SIGKILL)
            for c in ranks:
                with contextlib.suppress(psutil.Error):
                    c.kill()
            p.wait(30)
    assert p.returncode == 0, err.decode()[-2000:]
    assert b"no longer fits the context" in out and len(out.strip().splitlines()) == 2, out  # + the reply to "hi"
    f = tmp_path / "turns.txt"
    f.write_bytes(big)
    p = subprocess.run([*cmd, "-i", str(f)], capture_output=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0 and b"no longer fits the context" in p.stdout, p.stderr.decode()[-2000:]


@pytest.mark.hydra
@pytest.mark.mpi
@pytest.mark.full
def test_a_process_that_starts_mpi_but_not_ggpipe_ends_the_job(smollm2):
    """A non-ggpipe process that initialises MPI and exits normally: hydra
    signals nothing; the HELLO wait is bounded by GGPIPE_INIT_TIMEOUT
    (it was the 900 s load time-out)."""
    env = dict(os.environ, GGPIPE_INIT_TIMEOUT="3")
    t0 = time.monotonic()
    p = subprocess.run([mpiexec(), "-n", "1", *PY, "generate", "-m", str(smollm2), "-n", "4", "-p", "hi", ":",
                        "-n", "1", sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=env)
    assert time.monotonic() - t0 < 30 and p.returncode != 0
    ours = [ln for ln in p.stderr.splitlines() if ln.startswith("ggpipe: error: ")]
    assert len(ours) == 1 and "did not start a ggpipe job within 3 s" in ours[0], p.stderr
