"""Read and validate GGUF files.

Parsing is done by the ``gguf`` package (llama.cpp's own Python library):
:func:`load_gguf` opens a file with ``gguf.GGUFReader`` and turns every way a
user's file can be wrong (missing, a directory, empty, not GGUF, truncated,
corrupt) into a one-line :class:`~ggpipe.errors.ModelError`.

:func:`read_model_info` gives the few facts the rest of ggpipe needs
(:class:`ModelInfo`). ``GGUFReader`` builds one numpy view per vocabulary
string and takes about 2 s on the 49152-token SmolLM2 file, and every MPI rank
asks at every start, so the result is remembered in the cache directory
(``<cache>/hashes/<key>.info.json``, keyed by the file's realpath, size and
mtime, like the remembered sha256 hashes). Whether a model can be cut into
layer ranges is :mod:`ggpipe.models.slicing`'s question.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from gguf.constants import GGUFValueType, Keys
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS, ReaderField

from ggpipe.child_process import child_env, python_command
from ggpipe.errors import ModelError
from ggpipe.models.cache import remembered
from ggpipe.models.kv_size import KVLayout, layout_from_reader, layout_from_record

GGUF_MAGIC_BYTES = b"GGUF"

# What GGUFReader raises on a damaged file: short reads (IndexError, numpy
# view/reshape ValueErrors), unknown enum values (ValueError), duplicate keys
# (KeyError), bad UTF-8 (UnicodeDecodeError, a ValueError), ...
# Known gap: gguf 0.19.0 does not bound array lengths, so a corrupted length
# field (not a truncation) can keep it looping for a very long time; fixed
# upstream by llama.cpp PR #27188 ("gguf-py : add size guards to GGUFReader"),
# not yet in a gguf release.
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error)


# --------------------------------------------------------------------------
# Opening a GGUF
# --------------------------------------------------------------------------


def _one_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The reader last opened with keep=True, and the identity of its file.
_kept: tuple[tuple[int, int, int, int], GGUFReader] | None = None


def release_kept() -> None:
    """Drop the reader kept by ``load_gguf(keep=True)`` (unmaps its file, so
    its pages stop counting in this process's memory)."""
    global _kept
    _kept = None


def load_gguf(path: str | os.PathLike[str], keep: bool = False) -> GGUFReader:
    """Open ``path`` with ``gguf.GGUFReader`` after checking that it is a
    complete GGUF file: raises ModelError (one line) for anything else,
    including tensor data that would lie past the end of the file.

    ``keep=True`` keeps this reader (one at most, memory-mapped) so that the
    next call for the same unchanged file returns it at once: derive uses it
    for its source, which it may read several times in a row."""
    global _kept
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelError(f"{p} is a directory, not a GGUF model file")
    if not p.is_file():
        raise ModelError(f"{p} is not a regular file (a device, pipe or socket), not a GGUF model file")
    try:
        with open(p, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror or e}") from None
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if _kept is not None and _kept[0] == identity:
        return _kept[1]
    if keep:
        _kept = None  # let the previous mapping go first
    if head[:4] != GGUF_MAGIC_BYTES:
        what = "is empty" if not head else f"starts with {head[:4]!r}, not b'GGUF'"
        raise ModelError(f"{p} is not a GGUF model file (it {what}); give a .gguf file")
    if len(head) < 8:
        raise ModelError(f"GGUF file {p} is truncated or corrupt: it ends inside the header; download it again")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0 and version != 0:
        raise ModelError(f"GGUF file {p} is a big-endian GGUF, which ggpipe does not support")
    if version not in READER_SUPPORTED_VERSIONS:
        supported = " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        raise ModelError(f"GGUF file {p} has GGUF version {version}; only versions {supported} are supported")
    try:
        reader = GGUFReader(p)
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror or e}") from None
    except _READER_ERRORS as e:
        frames = {fr.name for fr in traceback.extract_tb(e.__traceback__)}
        where = "tensor data" if "_build_tensors" in frames else "header"
        raise ModelError(
            f"GGUF file {p} is truncated or corrupt: reading its {where} failed ({_one_line(e)}); download it again"
        ) from None
    size = int(reader.data.shape[0])
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise ModelError(
                f"GGUF file {p} is truncated: tensor {t.name} needs bytes up to {end} "
                f"but the file has only {size}; download it again"
            )
    if keep:
        _kept = (identity, reader)
    return reader


def field_value(reader: GGUFReader, key: str, path: Path | None = None) -> Any:
    """Python value of metadata ``key`` (``None`` if absent); ModelError if it
    cannot be decoded."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except _READER_ERRORS as e:
        where = f"GGUF file {path}" if path is not None else "GGUF file"
        raise ModelError(f"{where} is corrupt: cannot decode metadata {key} ({_one_line(e)})") from None


def array_length(field: ReaderField) -> int | None:
    """Number of elements of a flat array field (``None`` if not one)."""
    if field.types[:1] != [GGUFValueType.ARRAY] or len(field.types) != 2:
        return None
    return len(field.data)


# --------------------------------------------------------------------------
# Model info
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """A GGUF file's model facts (:func:`read_model_info`).

    Attributes:
        path: the file.
        arch: ``general.architecture``.
        n_layer, n_embd, n_vocab: blocks, hidden size, vocabulary size (tokens).
        n_ctx_train: ``{arch}.context_length`` (tokens; 0 when absent).
        chat_template: ``tokenizer.chat_template``, or None.
        bos_token_id, eos_token_id: the special tokens' ids, or None.
        file_size: the file's size (bytes).
        per_layer_keys: metadata keys with one value per block
            (:func:`per_layer_keys`), re-indexed on slicing.
        n_head, n_head_kv: attention heads, and K/V heads (None when absent).
        n_tensors: tensors in the file.
        kv_rows, kv_v_cache: the KV cache geometry per layer
            (:class:`ggpipe.models.kv_size.KVLayout`'s fields)."""

    path: Path
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    file_size: int
    per_layer_keys: tuple[str, ...]
    n_head: int | None = None
    n_head_kv: int | None = None
    n_tensors: int = 0
    # KV cache geometry per layer (ggpipe.models.kv_size.KVLayout's fields)
    kv_rows: tuple[tuple[int, int] | None, ...] = ()
    kv_v_cache: bool = True

    @property
    def kv_layout(self) -> KVLayout:
        """Per-layer KV rows, for ggpipe.models.kv_size.kv_bytes_per_cell."""
        return KVLayout(self.kv_rows, self.kv_v_cache)


def _int_key(reader: GGUFReader, path: Path, key: str, required: bool = True) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ModelError(f"GGUF file {path} has no {key} metadata; it is not a usable language model")
        return None
    if field.types[0] == GGUFValueType.ARRAY:  # per-layer array (e.g. head counts): report the first
        if not field.data or len(field.types) != 2:
            return None
        v = field.contents(0)
    else:
        v = field_value(reader, key, path)
    if isinstance(v, (bool, str)) or v is None:
        raise ModelError(f"GGUF file {path} has a non-integer {key} ({v!r})")
    return int(v)


# Fixed-length arrays that are not per layer, whatever the block count:
# M-RoPE's 4 rotary sections.
NOT_PER_LAYER = ("rope.dimension_sections",)


def per_layer_keys(reader: GGUFReader, n_layer: int) -> tuple[str, ...]:
    """Architecture metadata keys (``{arch}.*``) whose value is an array of
    exactly ``n_layer`` elements: one value per block, to re-index on slicing
    (except the fixed-length arrays of NOT_PER_LAYER)."""
    prefix = f"{field_value(reader, Keys.General.ARCHITECTURE)}."
    return tuple(k for k, f in reader.fields.items()
                 if k.startswith(prefix) and array_length(f) == n_layer and k[len(prefix):] not in NOT_PER_LAYER)


def info_from_reader(reader: GGUFReader, path: str | os.PathLike[str]) -> ModelInfo:
    """The :class:`ModelInfo` of an open GGUF (see :func:`load_gguf`)."""
    path = Path(path).expanduser()
    arch = field_value(reader, Keys.General.ARCHITECTURE, path)
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"GGUF file {path} has no general.architecture; it is not a llama.cpp model")
    n_layer = _int_key(reader, path, f"{arch}.block_count")
    assert n_layer is not None
    n_vocab = _int_key(reader, path, f"{arch}.vocab_size", required=False)
    if n_vocab is None:
        tok = reader.fields.get(Keys.Tokenizer.LIST)
        n_vocab = None if tok is None else array_length(tok)
        if n_vocab is None:
            raise ModelError(f"GGUF file {path} has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    tmpl = field_value(reader, Keys.Tokenizer.CHAT_TEMPLATE, path)
    n_embd = _int_key(reader, path, f"{arch}.embedding_length")
    assert n_embd is not None
    try:
        kv = layout_from_reader(reader, arch, n_layer, n_embd)
    except _READER_ERRORS as e:
        raise ModelError(f"GGUF file {path} is corrupt: cannot read its attention metadata ({_one_line(e)})") from None
    return ModelInfo(
        path=path,
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ctx_train=_int_key(reader, path, f"{arch}.context_length", required=False) or 0,
        chat_template=tmpl if isinstance(tmpl, str) else None,
        bos_token_id=_int_key(reader, path, Keys.Tokenizer.BOS_ID, required=False),
        eos_token_id=_int_key(reader, path, Keys.Tokenizer.EOS_ID, required=False),
        file_size=int(reader.data.shape[0]),
        per_layer_keys=per_layer_keys(reader, n_layer),
        n_head=_int_key(reader, path, f"{arch}.attention.head_count", required=False),
        n_head_kv=_int_key(reader, path, f"{arch}.attention.head_count_kv", required=False),
        n_tensors=len(reader.tensors),
        kv_rows=kv.rows,
        kv_v_cache=kv.v_cache,
    )


# Remembered ModelInfo records: bump when ModelInfo or its derivation changes.
_INFO_FORMAT = 3  # 2: kv_rows, kv_v_cache; 3: rope.dimension_sections is not per layer
_INFO_FIELDS = tuple(f.name for f in dataclasses.fields(ModelInfo) if f.name != "path")


def _info_record(info: ModelInfo) -> dict[str, Any]:
    rec = {k: getattr(info, k) for k in _INFO_FIELDS}
    rec["per_layer_keys"] = list(info.per_layer_keys)
    rec["kv_rows"] = [None if r is None else list(r) for r in info.kv_rows]
    rec["format"] = _INFO_FORMAT
    return rec


def _valid_info_record(rec: Any) -> bool:
    return isinstance(rec, dict) and rec.get("format") == _INFO_FORMAT and set(rec) - {"format"} == set(_INFO_FIELDS)


# gguf 0.19's GGUFReader trusts array lengths: some corrupted headers make it
# loop for hours (fixed upstream in llama.cpp PR #27188, not yet released). The
# first parse of a file therefore runs in a child process with this bound.
PARSE_TIMEOUT_S = 120.0

_CHILD = """
import json, sys
from pathlib import Path
from ggpipe.child_process import child_env, python_command
from ggpipe.errors import ModelError
from ggpipe.models.gguf_info import _info_record, info_from_reader, load_gguf
p = Path(sys.argv[1])
try:
    print(json.dumps({"record": _info_record(info_from_reader(load_gguf(p), p))}))
except ModelError as e:
    print(json.dumps({"error": str(e)}))
"""


def _parse_in_child(p: Path) -> dict[str, Any]:
    """Parse ``p``'s header with GGUFReader in a child process, bounded by
    PARSE_TIMEOUT_S. Raises ModelError for a file it cannot read in time."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    try:
        r = subprocess.run([*python_command(), "-c", _CHILD, str(p)], capture_output=True, text=True,
                           timeout=PARSE_TIMEOUT_S, check=False, env=child_env())
    except subprocess.TimeoutExpired:
        raise ModelError(f"GGUF file {p} could not be read in {PARSE_TIMEOUT_S:.0f} s: its header is corrupt; "
                         f"download it again") from None
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"GGUF file {p} is truncated or corrupt: reading it failed ({last}); download it again") from None
    if "error" in out:
        raise ModelError(out["error"])
    return out["record"]


def read_model_info(path: str | os.PathLike[str], cache_root: str | os.PathLike[str] | None = None) -> ModelInfo:
    """Validate a GGUF file and return its model facts (ModelError if unusable).

    Remembered under ``cache_root`` (default: the ggpipe cache directory) per
    (realpath, size, mtime) of the file; a cache that cannot be used just
    means parsing again."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelError(f"{p} is a directory, not a GGUF model file")

    def parse() -> dict[str, Any]:
        return _parse_in_child(p)

    try:
        rec = remembered(
            p, "info", parse, None if cache_root is None else Path(cache_root), _valid_info_record, strict=False
        )
    except FileNotFoundError:  # removed meanwhile
        raise ModelError(f"model file not found: {p}") from None
    fields = {k: v for k, v in rec.items() if k != "format"}
    fields["per_layer_keys"] = tuple(fields["per_layer_keys"])
    fields["kv_rows"] = layout_from_record(fields["kv_rows"]).rows
    return ModelInfo(path=p, **fields)
