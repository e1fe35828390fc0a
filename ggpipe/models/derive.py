"""Write a GGUF made of chosen blocks of another one.

One function, :func:`derive_gguf`, serves both uses:

* runtime stage slices (:func:`stage_slice`): the blocks ``[start, stop)`` of a
  model, tensor data copied raw, cached under ``<cache>/slices``;
* derived models of the registry (``models.toml``): e.g. the "Goliath"
  self-merge of SmolLM2 (blocks 0-19 then 10-29) converted to F16.

Output block ``i`` is source block ``layers[i]`` (renamed ``blk.i.*``),
``{arch}.block_count`` is ``len(layers)`` and every per-layer array key is
re-indexed the same way. Non-block tensors (``token_embd``, ``output_norm``,
``output``, ...) and every other metadata entry are kept; unchanged metadata
entries are copied byte for byte. The output is a deterministic function of
the inputs (same bytes, same sha256).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType, LlamaFileType

from ggpipe.errors import ModelError
from ggpipe.models.cache import (
    cache_dir as default_cache_dir,
    cached_sha256,
    ensure_dir,
    file_lock,
    remove_quietly,
    temp_path_for,
)
from ggpipe.models.gguf_info import (
    _SCALAR_FMT,
    _SCALAR_NP,
    GGUFFile,
    TensorEntry,
    check_sliceable,
    info_from_scan,
    read_model_info,
    scan_gguf,
)

OUT_TYPES = ("keep", "f16", "f32")
_GGUF_VERSION = 3
_COPY_CHUNK = 16 << 20
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_FLOAT_TARGET = {"f16": GGMLQuantizationType.F16, "f32": GGMLQuantizationType.F32}
_NP_OF = {GGMLQuantizationType.F16: np.dtype("<f2"), GGMLQuantizationType.F32: np.dtype("<f4")}
# Types that hold integers, not weights: never converted.
_INT_TYPES = {
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
    GGMLQuantizationType.F64,
}


# --------------------------------------------------------------------------
# Layer lists
# --------------------------------------------------------------------------


def parse_layer_list(text: str, n_layer: int | None = None) -> list[int]:
    """``"0-19,10-29"`` -> ``[0, 1, ..., 19, 10, ..., 29]``.

    Comma-separated single layers or inclusive ranges ``a-b`` (a <= b);
    repeats and any order are allowed. With ``n_layer``, every layer must be
    below it. Raises ModelError (a ValueError is never raised) on bad input."""
    if not isinstance(text, str) or not text.strip():
        raise ModelError("empty layer list; write layers like '0-19,10-29'")
    out: list[int] = []
    for part in text.split(","):
        item = part.strip()
        m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", item)
        if not m:
            raise ModelError(
                f"bad item {item!r} in layer list {text!r}: use layer numbers and inclusive ranges like '0-19,10-29'"
            )
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise ModelError(f"range {item!r} in layer list {text!r} goes backwards; write it as {b}-{a}")
        out.extend(range(a, b + 1))
    if n_layer is not None:
        bad = [x for x in out if x >= n_layer]
        if bad:
            raise ModelError(
                f"layer {bad[0]} in layer list {text!r} does not exist: the model has layers 0-{n_layer - 1}"
            )
    return out


def format_layer_list(layers: Sequence[int]) -> str:
    """Inverse of :func:`parse_layer_list` (compact ranges)."""
    parts: list[str] = []
    i = 0
    layers = list(layers)
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(parts)


# --------------------------------------------------------------------------
# GGUF encoding
# --------------------------------------------------------------------------


def _enc_str(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _enc_scalar_kv(key: str, vtype: int, value: Any) -> bytes:
    return _enc_str(key) + struct.pack("<I", vtype) + struct.pack(_SCALAR_FMT[vtype], value)


def _reindexed_array_kv(g: GGUFFile, key: str, layers: Sequence[int]) -> bytes:
    kv = g.kvs[key]
    head = _enc_str(key) + struct.pack("<IIQ", GGUFValueType.ARRAY, kv.subtype, len(layers))
    if kv.subtype in _SCALAR_NP:
        arr = np.asarray(kv.value)[list(layers)].astype(_SCALAR_NP[kv.subtype])
        return head + arr.tobytes()
    if kv.subtype == GGUFValueType.STRING:
        vals = g.array_strings(key)
        return head + b"".join(_enc_str(vals[i]) for i in layers)
    raise ModelError(f"{g.path}: per-layer metadata {key} is an array of arrays, which ggpipe cannot re-index")


def _pad(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass
class _OutTensor:
    name: str
    src: TensorEntry
    ggml_type: GGMLQuantizationType
    nbytes: int


def _target_type(t: TensorEntry, out_type: str) -> GGMLQuantizationType:
    if out_type == "keep" or t.ggml_type in _INT_TYPES:
        return t.ggml_type
    if out_type == "f16" and len(t.shape) == 1:
        return GGMLQuantizationType.F32  # norms and biases stay F32, as llama.cpp's converters do
    return _FLOAT_TARGET[out_type]


def _plan_tensors(g: GGUFFile, layers: Sequence[int], n_layer: int, out_type: str) -> list[_OutTensor]:
    pre: list[TensorEntry] = []
    post: list[TensorEntry] = []
    blocks: dict[int, list[tuple[str, TensorEntry]]] = {}
    for t in g.tensors:
        m = _BLK_RE.match(t.name)
        if m:
            b = int(m.group(1))
            if b >= n_layer:
                raise ModelError(f"GGUF file {g.path} has tensor {t.name} but block_count is {n_layer}")
            blocks.setdefault(b, []).append((m.group(2), t))
        elif blocks:
            post.append(t)
        else:
            pre.append(t)
    out: list[_OutTensor] = []

    def add(name: str, t: TensorEntry) -> None:
        tt = _target_type(t, out_type)
        nbytes = t.nbytes if tt == t.ggml_type else t.n_elements * _NP_OF[tt].itemsize
        out.append(_OutTensor(name, t, tt, nbytes))

    for t in pre:
        add(t.name, t)
    for i, src_layer in enumerate(layers):
        for suffix, t in blocks.get(src_layer, []):
            add(f"blk.{i}.{suffix}", t)
    for t in post:
        add(t.name, t)
    return out


class _HashingWriter:
    def __init__(self, f: BinaryIO, bar: Any) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.bar = bar
        self.pos = 0

    def write(self, data: Any, count_progress: bool = True) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.h.update(mv)
        self.pos += mv.nbytes
        if self.bar is not None and count_progress:
            self.bar.update(mv.nbytes)


def _write_tensor(w: _HashingWriter, mm: np.ndarray, g: GGUFFile, ot: _OutTensor) -> None:
    t = ot.src
    start = g.data_offset + t.offset
    if ot.ggml_type == t.ggml_type:
        for a in range(start, start + t.nbytes, _COPY_CHUNK):
            w.write(mm[a : min(a + _COPY_CHUNK, start + t.nbytes)])
        return
    from gguf.quants import dequantize

    row_len = t.shape[0]
    rows = t.n_elements // row_len
    raw = mm[start : start + t.nbytes].reshape(rows, t.nbytes // rows)
    np_out = _NP_OF[ot.ggml_type]
    step = max(1, _COPY_CHUNK // (row_len * 4))
    for r in range(0, rows, step):
        try:
            vals = dequantize(raw[r : r + step], t.ggml_type)
        except NotImplementedError:
            raise ModelError(
                f"cannot convert tensor {t.name} of {g.path.name} from {t.ggml_type.name}: "
                "the gguf package cannot dequantize that type; use type 'keep'"
            ) from None
        w.write(np.ascontiguousarray(vals, dtype=np.float32).astype(np_out, copy=False))


def _derive(
    src: str | os.PathLike[str],
    layers: Sequence[int],
    out_path: str | os.PathLike[str],
    out_type: str = "keep",
    progress: bool = False,
    desc: str | None = None,
) -> tuple[Path, str]:
    """:func:`derive_gguf`, also returning the sha256 of what it wrote."""
    if out_type not in OUT_TYPES:
        raise ModelError(f"unknown output type {out_type!r}: use one of {', '.join(OUT_TYPES)}")
    layers = [int(x) for x in layers]
    if not layers:
        raise ModelError("cannot derive a model with no layers")
    src = Path(src).expanduser()
    out_path = Path(out_path).expanduser()
    g = scan_gguf(src)
    info = info_from_scan(g)
    n = info.n_layer
    bad = [x for x in layers if not 0 <= x < n]
    if bad:
        raise ModelError(f"layer {bad[0]} does not exist in {src.name}: it has layers 0-{n - 1}")
    if layers != list(range(n)):
        check_sliceable(info)

    arch = info.arch
    per_layer = set(info.per_layer_keys)
    plan = _plan_tensors(g, layers, n, out_type)

    # ---- metadata
    kv_blobs: list[bytes] = []
    with open(src, "rb") as f:
        for key, kv in g.kvs.items():
            if key == f"{arch}.block_count":
                kv_blobs.append(_enc_scalar_kv(key, kv.vtype, len(layers)))
            elif key in per_layer:
                kv_blobs.append(_reindexed_array_kv(g, key, layers))
            elif key == "general.file_type" and out_type != "keep":
                continue  # written below
            else:
                f.seek(kv.start)
                kv_blobs.append(f.read(kv.end - kv.start))
    if out_type != "keep":
        ftype = LlamaFileType.MOSTLY_F16 if out_type == "f16" else LlamaFileType.ALL_F32
        kv_blobs.append(_enc_scalar_kv("general.file_type", GGUFValueType.UINT32, int(ftype)))

    # ---- tensor table
    align = g.alignment
    info_blobs: list[bytes] = []
    offset = 0
    for ot in plan:
        shape = ot.src.shape
        info_blobs.append(
            _enc_str(ot.name)
            + struct.pack("<I", len(shape))
            + struct.pack(f"<{len(shape)}Q", *shape)
            + struct.pack("<IQ", int(ot.ggml_type), offset)
        )
        offset = _pad(offset + ot.nbytes, align)
    header = (
        b"GGUF"
        + struct.pack("<IQQ", _GGUF_VERSION, len(plan), len(kv_blobs))
        + b"".join(kv_blobs)
        + b"".join(info_blobs)
    )
    header += b"\0" * (_pad(len(header), align) - len(header))
    total = len(header) + offset

    # ---- write
    ensure_parent = out_path.parent
    if not ensure_parent.is_dir():
        raise ModelError(f"cannot write {out_path}: directory {ensure_parent} does not exist")
    tmp = temp_path_for(out_path)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc or f"writing {out_path.name}")
    mm = np.memmap(src, dtype=np.uint8, mode="r")
    try:
        try:
            f = open(tmp, "xb")
        except OSError as e:
            raise ModelError(f"cannot write {out_path}: {e.strerror or e}") from None
        with f:
            w = _HashingWriter(f, bar)
            w.write(header)
            for ot in plan:
                _write_tensor(w, mm, g, ot)
                pad = _pad(ot.nbytes, align) - ot.nbytes
                if pad:
                    w.write(b"\0" * pad)
            if w.pos != total:  # pragma: no cover - internal consistency
                raise RuntimeError(f"derive wrote {w.pos} bytes, expected {total}")
        os.replace(tmp, out_path)
    except OSError as e:
        raise ModelError(f"cannot write {out_path}: {e.strerror or e}") from None
    finally:
        del mm
        remove_quietly(tmp)
        if bar is not None:
            bar.close()
    return out_path, w.h.hexdigest()


def derive_gguf(
    src: str | os.PathLike[str],
    layers: Sequence[int],
    out_path: str | os.PathLike[str],
    out_type: str = "keep",
    progress: bool = False,
) -> Path:
    """Write ``out_path``: a GGUF whose block ``i`` is block ``layers[i]`` of
    ``src``. ``out_type``: ``"keep"`` copies tensor data raw (any quantisation),
    ``"f16"``/``"f32"`` dequantise weights (1-D tensors stay F32 in f16).
    Written to a temporary file and renamed at the end. Returns ``out_path``."""
    return _derive(src, layers, out_path, out_type, progress)[0]


# --------------------------------------------------------------------------
# Runtime stage slices
# --------------------------------------------------------------------------


def _usable(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        scan_gguf(path)
    except ModelError:
        return False
    return True


def stage_slice(
    src: str | os.PathLike[str],
    start: int,
    stop: int,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The GGUF a stage owning layers ``[start, stop)`` of ``src`` loads.

    The whole model -> ``src`` itself. Otherwise a slice (tensor data copied
    raw) cached as ``<cache_dir>/slices/<sha256[:16] of src>-<start>-<stop>.gguf``,
    built once; safe when several processes ask at the same time."""
    src = Path(src).expanduser()
    info = read_model_info(src)
    n = info.n_layer
    if not (0 <= start < stop <= n):
        raise ModelError(f"layer range [{start}, {stop}) is not a non-empty range inside the {n} layers of {src.name}")
    if start == 0 and stop == n:
        return src
    check_sliceable(info)
    root = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    sha = cached_sha256(src, root)
    slices = ensure_dir(root / "slices")
    target = slices / f"{sha[:16]}-{start}-{stop}.gguf"
    if _usable(target):
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if not _usable(target):
            derive_gguf(src, range(start, stop), target, "keep")
    return target
