"""Every ``ggpipe`` command line shown in README.md and docs/ (in ``bash``
code blocks, after ``mpiexec``/``mpirun`` and their options, environment
assignments or ``python -m``) still parses: its subcommand exists, every
option it names exists and takes the values shown. click parses each line
(``make_context``) without running it, so the docs cannot drift from the
CLI. Values that name files the test does not have (``prompt.txt``) are not
checked; unknown commands and options are."""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import click
import pytest

from ggpipe.cli.main import cli
from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
STOP = {"|", "||", "&&", ";", ">", ">>", "2>", "&", "2>&1"}


def _lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command text) of each bash code-block command, continuations joined."""
    out, in_bash, buf, start = [], False, "", 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = line.strip().startswith("```")
        if fence:
            in_bash = not in_bash and line.strip() in ("```bash", "```sh", "```console", "```shell")
            continue
        if not in_bash:
            continue
        text = line.strip()
        if text.startswith("$ "):
            text = text[2:]
        if not buf:
            start = n
        if text.endswith("\\"):
            buf += text[:-1] + " "
            continue
        out.append((start, buf + text))
        buf = ""
    return out


def _ggpipe_args(command: str) -> list[str] | None:
    """The arguments after ``ggpipe`` in a shell line, or None if it runs no ggpipe."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for i, w in enumerate(words):
        if w in STOP or w.endswith(";"):
            words = words[:i] + ([w[:-1]] if w.endswith(";") and w != ";" else [])
            break
    # an elided part of the line ("generate … --mode"), not an option's value ("-p '…'")
    words = [w for i, w in enumerate(words) if w not in ("…", "...") or (i and words[i - 1].startswith("-"))]
    for i, w in enumerate(words):
        if w == "ggpipe" or (w == "-m" and i > 0 and words[i - 1].startswith("python") and
                             i + 1 < len(words) and words[i + 1] == "ggpipe"):
            j = i + 1 if w == "ggpipe" else i + 2
            head = words[:i]
            if all(re.match(r"^[A-Z_]+=", h) or h in ("mpiexec", "mpirun", "srun", "python", "python3", "time")
                   or h.startswith("-") or h.isdigit() or h.startswith("numactl") or "/" in h or ":" in h
                   for h in head):
                return words[j:]
    return None


def _rest(ctx: click.Context) -> list[str]:
    """A group's unparsed words: the subcommand and its arguments (click 8's
    ``protected_args`` + ``args``; click 9 keeps them all in ``args``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return list(getattr(ctx, "protected_args", [])) + list(ctx.args)


CASES = [(p, n, c) for p in DOCS for n, c in _lines(p) if _ggpipe_args(c) is not None]


def test_the_docs_show_commands():
    assert len(CASES) > 50


@pytest.mark.parametrize("path, line, command", CASES,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _ in CASES])
def test_a_documented_command_parses(path, line, command):
    args = _ggpipe_args(command)
    try:
        ctx = cli.make_context("ggpipe", list(args))
        name, cmd, rest = cli.resolve_command(ctx, _rest(ctx))
        if isinstance(cmd, click.Group):   # ggpipe models fetch ...
            sub = cmd.make_context(name, rest, parent=ctx)
            name, cmd, rest = cmd.resolve_command(sub, _rest(sub))
            ctx = sub
        cmd.make_context(name, rest, parent=ctx)
    except (click.exceptions.NoSuchOption, click.exceptions.BadOptionUsage) as e:
        pytest.fail(f"{path.relative_to(ROOT)}:{line}: {command}\n  {e.format_message()}")
    except click.exceptions.UsageError as e:
        msg = e.format_message()
        if "No such command" in msg or "Got unexpected extra argument" in msg:
            pytest.fail(f"{path.relative_to(ROOT)}:{line}: {command}\n  {msg}")
        # a file the docs name but the test lacks, a required option left out of a fragment: not drift
    except click.exceptions.Exit:
        pass    # --help, --version
