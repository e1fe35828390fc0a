"""Cache directory, file locks, atomic writes and remembered file facts
(hashes, GGUF model info).

Several processes (MPI ranks on one machine) may fetch a model, build a slice
or hash a file at the same moment. Each such target has a lock file next to it
(``fcntl.flock``); a process takes the lock, checks again whether another one
finished the work meanwhile, and only then does it. Results are written to a
temporary name in the target's directory and ``os.replace``d, so a file with
the final name is always complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ggpipe.errors import ModelError

CACHE_ENV = "GGPIPE_CACHE"
_HASH_CHUNK = 8 << 20


def cache_dir() -> Path:
    """``$GGPIPE_CACHE`` if set, else ``~/.cache/ggpipe`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "ggpipe"


def ensure_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and check that we can write there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ModelError(
            f"cache directory {path} is not writable ({e.strerror or e}); "
            f"set {CACHE_ENV} to a writable directory"
        ) from None
    return path


def temp_path_for(final: Path) -> Path:
    """A unique temporary name in ``final``'s directory (same filesystem, so
    ``os.replace`` is atomic). Hidden, and ends in ``.tmp``, never ``.gguf``."""
    return final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def remove_quietly(path: Path) -> None:
    """Delete the file ``path``; nothing happens when it does not exist."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``lock_path`` (created if missing, never deleted:
    deleting a lock file others may hold opens a race)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def sha256_file(path: Path, progress: bool = False, desc: str | None = None) -> str:
    """The SHA-256 of the file ``path`` as 64 hex digits, read in chunks;
    with ``progress``, a tqdm bar (bytes) on stderr labelled ``desc``."""
    h = hashlib.sha256()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=desc or f"hashing {path.name}")
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()


# ---- remembered facts about files: <cache>/hashes/<key>[.<kind>].json, keyed by
# (realpath, size, mtime_ns). "sha256" records hold a file's hash; other kinds
# (e.g. "info", see ggpipe.models.gguf_info) hold any JSON value.


def _record_path(path: Path, root: Path, kind: str) -> tuple[Path, str, os.stat_result]:
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(real.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    name = f"{key}.json" if kind == "sha256" else f"{key}.{kind}.json"
    return root / "hashes" / name, real, st


def _read_record(rec: Path, real: str, st: os.stat_result, kind: str, valid: Callable[[Any], bool]) -> Any | None:
    try:
        data = json.loads(rec.read_text())
    except (OSError, ValueError):
        return None
    if (
        isinstance(data, dict)
        and data.get("path") == real
        and data.get("size") == st.st_size
        and data.get("mtime_ns") == st.st_mtime_ns
        and data.get(kind) is not None
        and valid(data[kind])
    ):
        return data[kind]
    return None


def _write_record(rec: Path, real: str, st: os.stat_result, kind: str, value: Any) -> None:
    tmp = temp_path_for(rec)
    try:
        tmp.write_text(json.dumps({"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, kind: value}))
        os.replace(tmp, rec)
    finally:
        remove_quietly(tmp)


def remember(path: Path, kind: str, value: Any, root: Path | None = None) -> None:
    """Remember that ``path`` (as it is now: size, mtime) has ``kind`` ``value``."""
    root = cache_dir() if root is None else Path(root)
    ensure_dir(root / "hashes")
    rec, real, st = _record_path(path, root, kind)
    _write_record(rec, real, st, kind, value)


def remembered(
    path: Path,
    kind: str,
    compute: Callable[[], Any],
    root: Path | None = None,
    valid: Callable[[Any], bool] = lambda v: True,
    strict: bool = True,
) -> Any:
    """``compute()`` (a JSON value describing ``path``), computed once per
    (realpath, size, mtime_ns) of ``path`` and remembered under ``root/hashes``
    (``root`` defaults to :func:`cache_dir`). Processes asking at the same time
    wait for the one computing it. A record that fails ``valid`` is ignored.
    ``strict=False``: a cache that cannot be written just means computing
    again (no error); ``strict=True``: it raises ModelError / OSError."""
    root = cache_dir() if root is None else Path(root)
    rec, real, st = _record_path(path, root, kind)
    value = _read_record(rec, real, st, kind, valid)
    if value is not None:
        return value
    with contextlib.ExitStack() as stack:
        try:
            ensure_dir(root / "hashes")
            stack.enter_context(file_lock(rec.with_suffix(".lock")))
        except (ModelError, OSError):
            if strict:
                raise
            return compute()
        rec, real, st = _record_path(path, root, kind)
        value = _read_record(rec, real, st, kind, valid)
        if value is None:
            value = compute()
            after = os.stat(real)
            if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):
                try:
                    _write_record(rec, real, st, kind, value)
                except OSError:
                    if strict:
                        raise
    return value


def record_sha256(path: Path, sha: str, root: Path | None = None) -> None:
    """Remember that ``path`` (as it is now: size, mtime) has hash ``sha``."""
    remember(path, "sha256", sha, root)


def cached_sha256(path: Path, root: Path | None = None, progress: bool = False) -> str:
    """sha256 of ``path``, computed once per (realpath, size, mtime_ns) and
    remembered under ``root/hashes`` (``root`` defaults to :func:`cache_dir`)."""
    real = os.path.realpath(path)
    return remembered(
        path, "sha256", lambda: sha256_file(Path(real), progress=progress), root, valid=lambda v: isinstance(v, str)
    )
