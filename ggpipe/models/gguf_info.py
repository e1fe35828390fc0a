"""Read and validate GGUF files.

:func:`scan_gguf` parses a GGUF header (metadata and tensor table) with an
explicit bounds check on every read, so a truncated or corrupt file gives a
:class:`~ggpipe.errors.ModelError` that says what is wrong instead of a numpy
or struct crash. It also records where each metadata entry lies in the file, so
:mod:`ggpipe.models.derive` can copy entries byte for byte.

The type tables and tensor block sizes come from the ``gguf`` package
(llama.cpp's own Python library). We do not use ``gguf.GGUFReader`` to parse:
it builds one numpy view per vocabulary string and takes about 2 s on the
49152-token SmolLM2 file, where this scan takes a few hundredths of a second,
and it fails on truncated files with a reshape error.

:func:`read_model_info` gives the few facts the rest of ggpipe needs
(:class:`ModelInfo`); :func:`check_sliceable` refuses architectures that a
layer slice cannot keep exact.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ggpipe.errors import ModelError

GGUF_MAGIC_BYTES = b"GGUF"
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4

# Scalar value types: struct format (little-endian) and numpy dtype.
_SCALAR_FMT: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_NP: dict[int, np.dtype] = {t: np.dtype(f) for t, f in _SCALAR_FMT.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Architectures whose layer slices compute exactly what the whole model does
# (see NOTES-llamacpp.md): no embedding scale, no layer-index-dependent
# attention. Mistral GGUFs use the "llama" architecture.
SLICEABLE_ARCHS = ("llama", "qwen2", "qwen3")

_BLOCK_PREFIX = "blk."


# --------------------------------------------------------------------------
# Low-level scan
# --------------------------------------------------------------------------


@dataclass
class KVEntry:
    """One metadata entry.

    ``start``/``end``: the entry's bytes in the file, key included.
    ``value``: the decoded value for scalars and strings, a numpy array for
    arrays of scalars, ``None`` for arrays of strings/arrays (see
    :meth:`GGUFFile.array_strings`).
    """

    key: str
    vtype: int
    start: int
    end: int
    value: Any
    subtype: int | None = None  # element type of an array
    count: int | None = None  # element count of an array
    value_start: int = 0  # offset of the array's first element


@dataclass
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first
    offset: int  # relative to GGUFFile.data_offset
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFFile:
    path: Path
    file_size: int
    version: int
    alignment: int
    kvs: dict[str, KVEntry]  # in file order
    tensors: list[TensorEntry]  # in file order
    data_offset: int

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kvs.get(key)
        return default if kv is None else kv.value

    @property
    def arch(self) -> str:
        return self.get("general.architecture")

    def array_strings(self, key: str) -> list[str]:
        """Decode an array-of-strings entry (read from the file again)."""
        kv = self.kvs[key]
        if kv.vtype != GGUFValueType.ARRAY or kv.subtype != GGUFValueType.STRING:
            raise TypeError(f"{key} is not an array of strings")
        out: list[str] = []
        with open(self.path, "rb") as f:
            f.seek(kv.value_start)
            raw = f.read(kv.end - kv.value_start)
        pos = 0
        for _ in range(kv.count or 0):
            (n,) = _U64.unpack_from(raw, pos)
            pos += 8
            out.append(raw[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        return out


class _Bad(Exception):
    """Internal: a structural problem; message completes 'GGUF file X ...'."""


class _Truncated(_Bad):
    pass


class _Cursor:
    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf: Any, size: int) -> None:
        self.buf = buf
        self.pos = 0
        self.size = size

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(f"ends inside the header ({what} at byte {self.pos})")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        n = self.u64(what)
        self.need(n, what)
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(s)

    def string(self, what: str) -> str:
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad(f"has a {what} that is not UTF-8 (before byte {self.pos})") from None

    def skip_strings(self, count: int, what: str) -> None:
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            (n,) = unpack(buf, pos)
            pos += 8 + n
            if pos > size:
                self.pos = pos - n
                self.need(n, what)
        self.pos = pos


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[Any, int | None, int | None, int]:
    """Read one value; returns (value, subtype, count, value_start)."""
    fmt = _SCALAR_FMT.get(vtype)
    if fmt is not None:
        size = struct.calcsize(fmt)
        cur.need(size, f"value of {key}")
        (v,) = struct.unpack_from(fmt, cur.buf, cur.pos)
        cur.pos += size
        return v, None, None, 0
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key}"), None, None, 0
    if vtype == GGUFValueType.ARRAY:
        if depth > 8:
            raise _Bad(f"has arrays nested too deeply in {key}")
        subtype = cur.u32(f"array type of {key}")
        count = cur.u64(f"array length of {key}")
        start = cur.pos
        np_type = _SCALAR_NP.get(subtype)
        if np_type is not None:
            nbytes = count * np_type.itemsize
            cur.need(nbytes, f"array {key}")
            arr = np.frombuffer(cur.buf, dtype=np_type, count=count, offset=cur.pos).copy()
            cur.pos += nbytes
            return arr, subtype, count, start
        if subtype == GGUFValueType.STRING:
            cur.skip_strings(count, f"array {key}")
            return None, subtype, count, start
        if subtype == GGUFValueType.ARRAY:
            for _ in range(count):
                _read_value(cur, subtype, key, depth + 1)
            return None, subtype, count, start
        raise _Bad(f"has unknown array element type {subtype} in {key}")
    raise _Bad(f"has unknown value type {vtype} for {key}")


def _parse(buf: Any, size: int, path: Path) -> GGUFFile:
    cur = _Cursor(buf, size)
    cur.need(4, "magic")
    cur.pos = 4
    version = cur.u32("version")
    if version & 0xFFFF == 0 and version != 0:
        raise _Bad("is a big-endian GGUF, which ggpipe does not support")
    if version not in (2, 3):
        raise _Bad(f"has GGUF version {version}; only versions 2 and 3 are supported")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # Each entry takes at least 12 bytes: a garbage count must not make us loop forever.
    if n_kv * 12 > size or n_tensors * 24 > size:
        raise _Truncated(f"has a header that claims {n_kv} metadata entries and {n_tensors} tensors, more than fit in its {size} bytes")

    kvs: dict[str, KVEntry] = {}
    for i in range(n_kv):
        start = cur.pos
        key = cur.string(f"metadata key #{i}")
        if key in kvs:
            raise _Bad(f"has the metadata key {key!r} twice")
        vtype = cur.u32(f"type of {key}")
        value, subtype, count, vstart = _read_value(cur, vtype, key)
        kvs[key] = KVEntry(key, vtype, start, cur.pos, value, subtype, count, vstart)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in kvs:
        kv = kvs["general.alignment"]
        if kv.vtype != GGUFValueType.UINT32 or kv.value <= 0 or kv.value & (kv.value - 1):
            raise _Bad(f"has an invalid general.alignment ({kv.value!r}): must be a power of two")
        alignment = int(kv.value)

    tensors: list[TensorEntry] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        if name in names:
            raise _Bad(f"has the tensor {name!r} twice")
        names.add(name)
        n_dims = cur.u32(f"dimension count of {name}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise _Bad(f"has tensor {name} with {n_dims} dimensions (must be 1..{GGML_MAX_DIMS})")
        shape = tuple(cur.u64(f"shape of {name}") for _ in range(n_dims))
        raw_type = cur.u32(f"type of {name}")
        try:
            gtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise _Bad(f"has tensor {name} of unknown type {raw_type} (newer llama.cpp? update the gguf package)") from None
        offset = cur.u64(f"offset of {name}")
        if shape[0] % block:
            raise _Bad(f"has tensor {name} whose row length {shape[0]} is not a multiple of the {gtype.name} block size {block}")
        if offset % alignment:
            raise _Bad(f"has tensor {name} at offset {offset}, not a multiple of the alignment {alignment}")
        n_el = 1
        for d in shape:
            n_el *= d
        tensors.append(TensorEntry(name, gtype, shape, offset, n_el // block * type_size))

    data_offset = -(-cur.pos // alignment) * alignment
    return GGUFFile(path, size, version, alignment, kvs, tensors, data_offset)


def scan_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the header of a GGUF file and check that all its tensor data is
    inside the file. Raises ModelError for anything that is not a complete GGUF."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelError(f"{p} is a directory, not a GGUF model file")
    try:
        f = open(p, "rb")
    except OSError as e:
        raise ModelError(f"cannot read model file {p}: {e.strerror or e}") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            head = f.read(4)
            if head != GGUF_MAGIC_BYTES:
                what = "is empty" if not head else f"starts with {head!r}, not b'GGUF'"
                raise ModelError(f"{p} is not a GGUF model file (it {what}); give a .gguf file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelError(f"cannot read model file {p}: {e.strerror or e}") from None
        try:
            g = _parse(mm, size, p)
        except _Truncated as e:
            raise ModelError(f"GGUF file {p} is truncated or corrupt: it {e}; download it again") from None
        except _Bad as e:
            raise ModelError(f"GGUF file {p} is corrupt: it {e}") from None
        finally:
            mm.close()

    for t in g.tensors:
        end = g.data_offset + t.offset + t.nbytes
        if end > size:
            raise ModelError(
                f"GGUF file {p} is truncated: tensor {t.name} needs bytes up to {end} "
                f"but the file has only {size}; download it again"
            )
    return g


# --------------------------------------------------------------------------
# Model info
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
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


def _int_key(g: GGUFFile, key: str, required: bool = True) -> int | None:
    kv = g.kvs.get(key)
    if kv is None:
        if required:
            raise ModelError(f"GGUF file {g.path} has no {key} metadata; it is not a usable language model")
        return None
    v = kv.value
    if isinstance(v, np.ndarray):  # per-layer array (e.g. head counts): report the first
        if v.size == 0:
            return None
        v = v.flat[0]
    if isinstance(v, (bool, str)) or v is None:
        raise ModelError(f"GGUF file {g.path} has a non-integer {key} ({v!r})")
    return int(v)


def per_layer_keys(g: GGUFFile, n_layer: int) -> tuple[str, ...]:
    """Architecture metadata keys (``{arch}.*``) whose value is an array of
    exactly ``n_layer`` elements: one value per block, to re-index on slicing."""
    prefix = f"{g.arch}."
    return tuple(
        k
        for k, kv in g.kvs.items()
        if k.startswith(prefix) and kv.vtype == GGUFValueType.ARRAY and kv.count == n_layer
    )


def info_from_scan(g: GGUFFile) -> ModelInfo:
    arch = g.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"GGUF file {g.path} has no general.architecture; it is not a llama.cpp model")
    n_layer = _int_key(g, f"{arch}.block_count")
    assert n_layer is not None
    n_vocab = _int_key(g, f"{arch}.vocab_size", required=False)
    if n_vocab is None:
        tok = g.kvs.get("tokenizer.ggml.tokens")
        if tok is None or tok.count is None:
            raise ModelError(f"GGUF file {g.path} has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
        n_vocab = tok.count
    tmpl = g.get("tokenizer.chat_template")
    return ModelInfo(
        path=g.path,
        arch=arch,
        n_layer=n_layer,
        n_embd=_int_key(g, f"{arch}.embedding_length"),  # type: ignore[arg-type]
        n_vocab=n_vocab,
        n_ctx_train=_int_key(g, f"{arch}.context_length", required=False) or 0,
        chat_template=tmpl if isinstance(tmpl, str) else None,
        bos_token_id=_int_key(g, "tokenizer.ggml.bos_token_id", required=False),
        eos_token_id=_int_key(g, "tokenizer.ggml.eos_token_id", required=False),
        file_size=g.file_size,
        per_layer_keys=per_layer_keys(g, n_layer),
        n_head=_int_key(g, f"{arch}.attention.head_count", required=False),
        n_head_kv=_int_key(g, f"{arch}.attention.head_count_kv", required=False),
        n_tensors=len(g.tensors),
    )


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """Validate a GGUF file and return its model facts (ModelError if unusable)."""
    return info_from_scan(scan_gguf(path))


_SLICE_REFUSALS = {
    "gemma": "it scales the input embedding (f_embedding_scale), which a stage fed hidden states would apply again",
    "gemma2": "it scales the input embedding and alternates sliding-window and global attention by layer index",
    "gemma3": "it scales the input embedding and picks sliding-window or global attention by layer index",
    "gemma3n": "it scales the input embedding and picks attention type by layer index",
}


def check_sliceable(info: ModelInfo) -> None:
    """Raise ModelError unless cutting ``info``'s model into layer ranges keeps
    its output exact. Whole-model (single-stage) runs never need this."""
    if info.arch in SLICEABLE_ARCHS:
        return
    why = _SLICE_REFUSALS.get(info.arch)
    if why is None and info.arch.startswith("gemma"):
        why = _SLICE_REFUSALS["gemma3"]
    if why is None:
        why = "ggpipe has not verified that a layer slice of it computes the same as the whole model"
    raise ModelError(
        f"cannot split {info.path.name} (architecture {info.arch!r}) into layer ranges: {why}; "
        f"run it as a single stage, or use a {'/'.join(SLICEABLE_ARCHS)} model"
    )
