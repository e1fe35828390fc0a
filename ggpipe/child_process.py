"""How ggpipe starts ggpipe in a child process (``ggpipe bench``'s runs, the
bench helpers, the scripts): the same ggpipe as the parent runs, whatever the
working directory holds.

``python -m ggpipe`` puts the working directory first on the child's
``sys.path``. Started inside a clone after a non-editable install (the
README's ``pip install ".[mpich]"``), that imported the source tree, which has
no compiled ``_native``, instead of the installed package: every run ended in
an ImportError. The child is started with ``-P`` (Python >= 3.11, which
ggpipe requires): nothing unsafe is put on its ``sys.path``, so it imports what
the interpreter's own paths give (the installed or editable package, and
``PYTHONPATH``). A parent that itself imported ggpipe through that unsafe
entry (``cd tree && python -m ggpipe ...`` in a source tree that is not
installed) passes the tree on in ``PYTHONPATH``, so the child runs that tree
too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import ggpipe


def python_command(python: str | os.PathLike | None = None) -> list[str]:
    """``[python, "-P"]``: a Python that keeps the working directory (and a
    script's directory) off ``sys.path``; ``python`` defaults to this one."""
    return [str(python or sys.executable), "-P"]


def ggpipe_command(python: str | os.PathLike | None = None) -> list[str]:
    """The argv prefix that runs the ``ggpipe`` command in a child: add the
    subcommand and its options (and put a launcher such as ``mpiexec -n R``
    before it)."""
    return [*python_command(python), "-m", "ggpipe"]


def _package_root() -> Path:
    return Path(ggpipe.__file__).resolve().parent.parent


def _resolved(entry: str) -> Path:
    return Path(entry or os.getcwd()).resolve()


def imported_through_unsafe_path() -> Path | None:
    """The directory this process imported ggpipe from when only the unsafe
    first ``sys.path`` entry (the working directory of ``python -m``/``-c``,
    or a script's directory) holds it; else None."""
    if sys.flags.safe_path or not sys.path:
        return None
    root = _package_root()
    if _resolved(sys.path[0]) != root or any(_resolved(e) == root for e in sys.path[1:]):
        return None
    return root


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child started with :func:`ggpipe_command` (a copy
    of ``env``, default ``os.environ``): with this process's source tree
    first on ``PYTHONPATH`` when only the working directory gave it ggpipe."""
    out = dict(os.environ if env is None else env)
    root = imported_through_unsafe_path()
    if root is not None:
        out["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [out.get("PYTHONPATH")])])
    return out
