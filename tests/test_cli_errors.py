"""Bad input gives one clear line on stderr and a non-zero exit, never a hang
or a traceback — under real MPI ranks where the error involves them."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_ggpipe


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, smollm2):
    d = tmp_path_factory.mktemp("bad")
    trunc = d / "truncated.gguf"
    trunc.write_bytes(smollm2.read_bytes()[:1_000_000])
    notgguf = d / "notgguf.gguf"
    notgguf.write_text("this is not a model\n")
    from ggpipe.models.derive import derive_gguf

    three = derive_gguf(smollm2, [0, 1, 2], d / "three-layers.gguf")
    import gguf

    gemma = d / "gemma3-fake.gguf"
    w = gguf.GGUFWriter(str(gemma), "gemma3")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_context_length(128)
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.zeros((3, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"trunc": trunc, "notgguf": notgguf, "three": three, "gemma": gemma}


CASES = [
    # (id, model key or literal, extra args, ranks, expected message fragment)
    ("missing-file", "/nonexistent/model.gguf", [], None, "model file not found"),
    ("truncated", "trunc", [], None, "truncated"),
    ("not-gguf", "notgguf", [], None, "not a GGUF"),
    ("unknown-name", "no-such-model", [], None, "unknown model 'no-such-model'"),
    ("split-count", "smollm2", ["--split", "0.3,0.3,0.4"], 2, "--split describes 3 target stages but the job has 2 ranks"),
    ("zero-layer-stage", "smollm2", ["--split", "0.001,1"], 2, "gets no layers"),
    ("bad-split-text", "smollm2", ["--split", "0.5,abc"], 2, "--split"),
    ("more-stages-than-layers", "three", [], 4, "4 stages but the target model has only 3 layers"),
    ("prompt-too-long", "smollm2", ["-c", "64", "-p", "word " * 300], 2, "but the context holds 64"),
    ("unsliceable-arch", "gemma", [], 2, "cannot split"),
    ("bad-threads", "smollm2", ["-t", "1,2,3"], 2, "-t lists 3 thread counts but the job has 2 ranks"),
    ("bad-temperature", "smollm2", ["--temp", "-1"], None, "temperature"),
]


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line(case, bad_files, smollm2):
    _, model, extra, ranks, fragment = case
    path = {"smollm2": smollm2, **bad_files}.get(model, model)
    args = ["generate", "-m", str(path), "-n", "4", *extra]
    if "-p" not in extra:
        args += ["-p", "hello"]
    p = run_ggpipe(args, ranks, timeout=120)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert fragment in lines[0], lines[0]
    assert p.stdout == ""


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


def _rank_pids(root_pid: int, rank: int) -> list[int]:
    import psutil

    out = []
    for c in psutil.Process(root_pid).children(recursive=True):
        try:
            if c.environ().get("PMI_RANK") == str(rank) and "ggpipe" in " ".join(c.cmdline()):
                out.append(c.pid)
        except psutil.Error:
            pass
    return out


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

    from conftest import ROOT, mpiexec

    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "ggpipe", "generate", "-m", str(smollm2),
           "-p", "Once upon a time", "-n", "1500", "--ignore-eos", "--timeout", "3"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert p.stdout.read(1)  # the head has started streaming tokens
        pids = _rank_pids(p.pid, 1)
        assert pids, "rank 1 not found"
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
