"""Where a command may write: every ``-o``/``--output`` is resolved first
(``..``, symlinks, also through folders that do not exist yet) and then
checked, before any folder is made and before any work starts.

``batch -o newdir/../in.jsonl`` names the input file as surely as
``-o in.jsonl``; checked as written, the path does not exist (``newdir`` does
not), so a check of the path as given lets it through and the write, after
``newdir`` is made, lands on the input. :func:`check_output` resolves the
path the way the write will reach it (:meth:`pathlib.Path.resolve`, not
strict) and checks that: not an input, of the right kind (a file or a
folder), not a file ggpipe did not write (the caller's ``foreign`` check),
and inside a folder that exists or can be made. Every command with an
output uses it: ``batch``, ``calibrate``, ``bench``, ``split``, ``timeline``.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from ggpipe.errors import ConfigError


def resolve(path: str | os.PathLike) -> Path:
    """``path`` absolute, symlinks and ``..`` resolved, also past folders that
    do not exist yet (``newdir/../x.json`` -> ``$PWD/x.json``)."""
    return Path(path).expanduser().resolve(strict=False)


def check_output(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (),
                 directory: bool = False, foreign: Callable[[Path], str | None] | None = None,
                 what: str = "the output") -> Path:
    """Resolve ``path`` (:func:`resolve`) and check it as a place to write;
    returns the resolved path, which the caller writes to. Nothing is left
    behind.

    Args:
        inputs: the command's input files; the output may be none of them.
        directory: the output is a folder (else a regular file).
        foreign: for an existing output, why it is not ggpipe's to change
            (a sentence), or None where it is.
        what: how messages name the output.

    Raises:
        ConfigError: the output is an input; it exists and is of the other
            kind, or not a regular file or folder (a device, a FIFO); it
            is a file ggpipe did not write; its nearest existing parent is not
            a folder, or nothing can be made in it (tried with an empty
            folder, removed at once: ``/proc``, a read-only mount).
    """
    given = Path(path)
    out = resolve(given)
    shown = str(given) if str(given) == str(out) else f"{given} (that is {out})"
    for inp in inputs:
        if inp is not None and _same(out, Path(inp)):
            raise ConfigError(f"{what} {shown} is the input file; give another path with -o")
    st = None
    # the path as given first: the kernel follows /dev/stdout's magic link to the pipe itself, where the
    # resolved name (/proc/PID/fd/pipe:[N]) is no file; then as resolved (newdir/../x, newdir not made yet)
    for candidate in (given.expanduser(), out):
        try:
            st = candidate.stat()
            break
        except (FileNotFoundError, NotADirectoryError):   # not there (or under a file: said below)
            continue
        except OSError as e:
            raise ConfigError(f"cannot use {what} {shown}: {e.strerror or e}") from None
    if st is not None:
        if directory and not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what} {shown} exists and is not a folder; give a folder with -o")
        if not directory and stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{what} {shown} is a directory; give a file path with -o")
        if not directory and not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {shown} is not a regular file (a device, pipe or terminal); give a file "
                              f"path with -o")
        why = foreign(out) if foreign is not None else None
        if why:
            raise ConfigError(f"{what} {shown} {why}")
        return out
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {what} {shown}: {parent} is not a folder")
    try:    # tried, not guessed from mode bits (root passes those; /proc and read-only mounts do not)
        os.rmdir(tempfile.mkdtemp(prefix=".ggpipe-check-", dir=parent))
    except OSError as e:
        raise ConfigError(f"cannot write {what} {shown}: nothing can be made in {parent} "
                          f"({e.strerror or e})") from None
    return out


def make_parent(path: Path, what: str = "the output") -> None:
    """Make the folder that will hold ``path`` (and its parents).

    Raises:
        ConfigError: it cannot be made (no permission, a read-only file
            system, a file in the way).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make the folder of {what} {path}: {e.strerror or e}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {what} {path}: the folder {path.parent} is not writable")


def _same(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are one file (the same inode, or the same resolved path)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return resolve(a) == resolve(b)
