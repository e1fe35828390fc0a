"""Every command that starts ggpipe in a child process (``ggpipe bench``, the
bench helpers, the scripts) starts the ggpipe the parent runs, from whatever
directory it is started in.

Started inside the clone after the README's non-editable install
(``pip install ".[mpich]"``), ``python -m ggpipe`` put the working directory
first on ``sys.path`` and imported the source tree (no compiled ``_native``)
instead of the installed package: every bench run ended in an ImportError.
A *fake clone* (a directory whose ``ggpipe/__init__.py`` raises ImportError)
stands in for the source tree here, so that the tests need no second install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

FAKE_MESSAGE = "the source tree's ggpipe was imported (fake clone)"


def fake_clone(d: Path) -> Path:
    """A directory that looks like a clone without the compiled extension."""
    (d / "ggpipe").mkdir(parents=True)
    (d / "ggpipe" / "__init__.py").write_text(f"raise ImportError({FAKE_MESSAGE!r})\n")
    (d / "ggpipe" / "__main__.py").write_text(f"raise ImportError({FAKE_MESSAGE!r})\n")
    return d


@pytest.fixture(params=["inside", "outside"])
def where(request, tmp_path) -> Path:
    """The working directory of the parent: a fake clone, or a plain directory."""
    d = tmp_path / "cwd"
    if request.param == "inside":
        return fake_clone(d)
    d.mkdir()
    return d


def test_the_child_command_imports_the_running_ggpipe(where):
    from ggpipe.child_process import child_env, ggpipe_command, python_command

    p = subprocess.run([*ggpipe_command(), "--version"], cwd=where, env=child_env(), capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0 and "version" in p.stdout, p.stderr[-2000:]
    p = subprocess.run([*python_command(), "-c", "import ggpipe; print(ggpipe.__file__)"], cwd=where,
                       env=child_env(), capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and Path(p.stdout.strip()).resolve() == (ROOT / "ggpipe" / "__init__.py").resolve(), p


def test_a_parent_run_from_a_source_tree_starts_that_tree(tmp_path):
    """A parent that imported ggpipe from its working directory (a source
    tree with the extension built in place, not installed: ``cd tree &&
    python -m ggpipe bench``) starts that tree's ggpipe, not another one."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "ggpipe", tree / "ggpipe", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import subprocess, ggpipe; from ggpipe.child_process import child_env, python_command; "
            "print(ggpipe.__file__); "
            "subprocess.run([*python_command(), '-c', 'import ggpipe; print(ggpipe.__file__)'], env=child_env(), "
            "check=True)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    parent, child = (Path(x).resolve() for x in p.stdout.split())
    assert parent == child == (tree / "ggpipe" / "__init__.py").resolve()


def test_no_launch_bypasses_the_helper():
    """Every place in ggpipe/ and scripts/ that starts ggpipe (or imports it
    in a child Python) goes through ggpipe.child_process, which keeps the working
    directory off the child's sys.path."""
    bad = []
    launch = re.compile(r"""["']-m["'],\s*["']ggpipe\b|-m ggpipe\b|["']-c["'],\s*["'][^"']*\bggpipe\b""")
    exempt = {"ggpipe/child_process.py",      # the helper itself
              "ggpipe/__main__.py",           # its docstring names ``python -m ggpipe``
              "scripts/dead_rank_trials.py"}  # runs the clone's own tests, in the clone, on purpose
    for base in ("ggpipe", "scripts"):
        for f in sorted((ROOT / base).rglob("*")):
            if (f.suffix not in (".py", ".sh", ".sbatch") or f.name.startswith("soak")
                    or str(f.relative_to(ROOT)) in exempt):
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if launch.search(line) and "python -P -m ggpipe" not in line and "ggpipe.bench.pingpong" not in line:
                    bad.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


@pytest.mark.full
def test_bench_runner_in_a_fake_clone(tmp_path, smollm2):
    """ggpipe.bench.runner.ggpipe_run (the scripts' bench helper), one process,
    started in the fake clone without cwd='/' as a work-around."""
    from ggpipe.bench.runner import ggpipe_run

    d = fake_clone(tmp_path / "clone")
    out = ggpipe_run(str(smollm2), "Hello", 2, None, cwd=str(d), timeout_s=120)
    assert len(out["tokens"]) == 2


@pytest.mark.mpi
@pytest.mark.full
def test_ggpipe_bench_from_inside_and_outside_the_clone(where, tmp_path, smollm2):
    """The README's case: the installed ``ggpipe`` command (the console
    script beside the interpreter) runs ``ggpipe bench`` in the clone."""
    exe = Path(sys.executable).parent / "ggpipe"
    if not exe.exists():
        pytest.skip(f"no ggpipe console script beside {sys.executable}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "hi", "prompt": "The capital of France is"}) + "\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([str(exe), "bench", "-m", str(smollm2), "--modes", "iterative", "--ranks", "1", "-n", "2",
                        "--prompts", str(prompts), "--no-chat", "--no-progress", "-o", str(out)],
                       cwd=where, env=env, capture_output=True, text=True, timeout=300, check=False)
    runs = [json.loads(f.read_text()) for f in (out / "runs").glob("*.json")] if (out / "runs").is_dir() else []
    assert FAKE_MESSAGE not in p.stderr + json.dumps(runs)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["status"] for r in runs] == ["ok"] and len(runs[0]["result"]["tokens"]) == 2


def test_reading_a_model_in_a_fake_clone(tmp_path, monkeypatch, smollm2):
    """The first read of a model's facts parses its header in a child Python
    (bounded in time); in a clone that child imported the clone's ggpipe, and a
    failing import was reported as 'truncated or corrupt ... download it again'."""
    from ggpipe.models.gguf_info import read_model_info

    monkeypatch.chdir(fake_clone(tmp_path / "clone"))
    assert read_model_info(smollm2, cache_root=tmp_path / "cache").n_layer == 30
