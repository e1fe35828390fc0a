"""The repository's text describes the product, not how it was made: no
tracked file (``git ls-files``; binary files skipped) has a line that cites a
tracker issue of this project as the reason for code ("issue 29 item 7"), a
work session ("the previous session", "3rd session"), or the machine it was
developed on ("this VM", "the build machine"). Upstream references (llama.cpp
PR #27188) and the code's own sessions (``ggpipe.cluster.session.Session``,
HTTP and chat sessions) are fine. Pure file checks: the fast tier."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: Paths not checked yet: a file's path, or a folder's with a trailing "/".
#: Shrink it as those files are rewritten; the goal is an empty tuple.
EXCLUDED: tuple[str, ...] = ()

#: This file names the patterns it looks for in its docstring.
SELF = "tests/test_repository_text.py"

#: What a line may not say, each with the reason shown when it does.
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # issue numbers: "issue 29", "(issue 29, item 4)", "Issue 27 item 6:", "issue #12"; not "issue 2 runs" (a verb)
    ("an issue number", re.compile(r"\b[Ii]ssues? #?\d+(?=\s*(?:[,.:;)\]]|items?\b|parts?\b|$))|\b[Ii]ssues? #\d+")),
    # issues by name or as the source of a requirement
    ("an issue by name", re.compile(r"\b[Ii]ssue [\"“']|\b[Tt]he issue's\b")),
    ("an issue as a requirement",
     re.compile(r"\b[Ii]ssue (?:adds|asks|expected|expects|lists|requires|says|wants)\b")),
    # work sessions: "work session", "the previous session", "3rd session", "session 25"
    ("a work session", re.compile(r"\bwork(?:ing)? sessions?\b|\b\d+(?:st|nd|rd|th) session\b"
                                  r"|\b(?:previous|earlier|next|later) sessions?\b|\b[Ss]essions? \d+\b")),
    # the development machine: "this VM", "the VM's", "the 2-core VM", "this project's 2-core machine";
    # hardware described as such ("a 2-core VM (AMD EPYC, ...)", "a shared 2-core machine") is fine
    ("the development machine", re.compile(r"\b(?:this|the|our) (?:\d+-(?:core|cpu|CPU) )?VM\b|\bbuild machine\b"
                                           r"|\bthis project's (?:[\w-]+ )?(?:VM|machine|host|box)\b")),
    # the repository's starting point as history: "the seed code", "since the seed"
    ("the project's history", re.compile(r"\bseed (?:code|repo|repository|project|commit|version)\b"
                                         r"|\bsince the seed\b")),
)

#: An upstream project's tracker, which is a fine thing to cite.
UPSTREAM = re.compile(r"\b(?:llama\.cpp|ggml|gguf-py|llama-cpp-python|mpich|open ?mpi|mpi4py|upstream)\b[^.]*"
                      r"\b(?:issue|PR|pull)\b", re.IGNORECASE)


def _excluded(path: str) -> bool:
    return path == SELF or any(path == e or (e.endswith("/") and path.startswith(e)) for e in EXCLUDED)


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for path in out.decode("utf-8", "surrogateescape").split("\0"):
        if not path or _excluded(path) or not (ROOT / path).is_file():
            continue
        files.append(path)
    return files


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, reason, line) of every line of ``text`` that speaks of
    issues, work sessions or the development machine."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for reason, pattern in PATTERNS:
            if pattern.search(line) and not UPSTREAM.search(line):
                found.append((n, reason, line.strip()))
                break
    return found


@pytest.mark.parametrize("line", [
    "(issue 29 item 13: ``-c 100000000000`` grew the head)",
    "ROOT_RESERVE = 1  # the next root's (issue 29, item 4)",
    '"""Issue 29: "temperature": 1e-320 divided the logits',
    "(Minions section 3.3's claim, issue \"Minions and PipeDec\"): does",
    "the context (the hardening issue expected \"KV cache is full\" here)",
    "The issue's cases, for real",
    "root lost up to 0.90x on this project's 2-core VM on prompts",
    "3 ranks x 1 thread on the 2-core VM",
    "the one-token rule under-counted: the VM's 18 ms draft steps",
    "measured in the previous session",
    "as the 3rd session found",
    "numbers from session 25",
    "run on the build machine",
])
def test_patterns_catch_history(line):
    assert offending_lines(line), line


@pytest.mark.parametrize("line", [
    "and holds the running job's :class:`Session`.",
    "def open_session(config: ClusterConfig) -> Session:",
    "every rank opens the session; the head serves",
    "the chat session keeps its history",
    "KV operations apply in issue order, as on a real pipeline",
    "the head may issue 2 runs at once",
    "fixed upstream in llama.cpp PR #27188, not yet released",
    "llama.cpp issue #1234 tracks it",
    "random quants from the seed under fixed scales",
    "on a shared 2-core machine the median moved by milliseconds",
    "Hardware: a 2-core VM (AMD EPYC, AVX-512, no AMX), 24 GiB.",
    "without a hostfile every rank is on this host",
])
def test_patterns_leave_the_product_alone(line):
    assert not offending_lines(line), line


def test_excluded_set_is_the_shrinkable_one():
    assert _excluded(SELF)
    assert not _excluded("ggpipe/__init__.py") and not _excluded("docs.md")
    assert not _excluded("README.md") and not _excluded("docs/index.md") and not _excluded("CHANGELOG.md")


def test_no_tracked_file_speaks_of_issues_sessions_or_the_build_machine():
    bad = []
    for path in _tracked_text_files():
        text = _text(ROOT / path)
        if text is None:
            continue
        bad += [f"{path}:{n}: ({reason}) {line}" for n, reason, line in offending_lines(text)]
    assert not bad, ("say what the code does, not which issue, work session or machine it came from:\n"
                     + "\n".join(bad))


def test_version_is_the_one_in_pyproject_and_the_changelog_exists():
    """``ggpipe --version`` (click's version option reads the installed
    package's metadata) and ``ggpipe.__version__`` say pyproject.toml's version."""
    import importlib.metadata
    import tomllib

    import ggpipe

    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    assert ggpipe.__version__ == version
    assert importlib.metadata.version("ggpipe") == version
    assert (ROOT / "CHANGELOG.md").is_file()
