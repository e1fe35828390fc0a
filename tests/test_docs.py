"""The documentation: README.md is a landing page of at most 300 lines, every
relative link in README.md and docs/ points at a file that exists, and the
site builds with ``mkdocs build --strict`` (mkdocs.yml; the ``docs`` extra).
Pure file checks plus one mkdocs build (a few seconds): the fast tier."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300

# [text](target) and ![alt](target), not inside inline code; a target ends at
# the first space (a title may follow) or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link outside code blocks and
    code spans; external (scheme:, //), mail and in-page (#...) links are left out."""
    links, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("//", "#")):
                continue
            links.append((n, target))
    return links


def test_readme_is_a_landing_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; keep it under {MAX_README_LINES} and move details into docs/")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for n, target in _relative_links(path):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not file_part:
            continue
        if not (path.parent / file_part).exists():
            broken.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


_REPO_PATH = re.compile(r"\b((?:scripts|tests)/[\w./-]+\.(?:py|sh|sbatch|jsonl|json))\b")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_scripts_and_tests_exist(path):
    """A script or test the text names (``scripts/bench_parallel.py``,
    ``tests/test_parallel.py::test_...``) is where it says, so that a moved or
    renamed file is followed here."""
    missing = sorted({m for m in _REPO_PATH.findall(path.read_text(encoding="utf-8")) if not (ROOT / m).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_readme_keeps_the_commands_ci_runs():
    """.ci/run runs what README "Development and tests" gives; keep them in step."""
    text = README.read_text(encoding="utf-8")
    for command in ('python -m pip install -e ".[mpich,test]"', "python -m pytest -q ",
                    "python -m pytest -q -rs --full", "bash scripts/test_exact_build.sh",
                    "bash scripts/test_openmpi.sh --ci"):
        assert command in text, f"README.md lacks {command!r}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason='mkdocs and mkdocs-material are not installed (pip install -e ".[docs]")')
def test_mkdocs_build_strict(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
