"""Write a GGUF made of chosen blocks of another one.

One function, :func:`derive_gguf`, serves both uses:

* runtime stage slices (:func:`stage_slice`): the blocks ``[start, stop)`` of a
  model, tensor data copied raw, cached under ``<cache>/slices``;
* derived models of the registry (``models.toml``): e.g. the "Goliath"
  self-merge of SmolLM2 (blocks 0-19 then 10-29) converted to F16.

Output block ``i`` is source block ``layers[i]`` (renamed ``blk.i.*``),
``{arch}.block_count`` is ``len(layers)`` and every per-layer array key is
re-indexed the same way. Non-block tensors (``token_embd``, ``output_norm``,
``output``, ...) and every other metadata entry are kept, with the same
types and values. Reading and writing are done by the ``gguf`` package
(``GGUFReader``/``GGUFWriter``). The output is a deterministic function of
the inputs (same bytes, same sha256).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType, GGUFValueType, Keys, LlamaFileType
from gguf.gguf_reader import ReaderTensor
from gguf.lazy import LazyNumpyTensor
from gguf.quants import dequantize

from ggpipe.errors import ModelError
from ggpipe.models.cache import (
    cache_dir as default_cache_dir,
)
from ggpipe.models.cache import (
    cached_sha256,
    ensure_dir,
    file_lock,
    remove_quietly,
    sha256_file,
    temp_path_for,
)
from ggpipe.models.gguf_info import (
    release_kept,
    ModelInfo,
    field_value,
    info_from_reader,
    load_gguf,
    read_model_info,
)
from ggpipe.models.slicing import check_sliceable, slice_metadata

OUT_TYPES = ("keep", "f16", "f32")
# Version of what a stage slice holds (ggpipe.models.slicing), in its cached
# name: a slice cut by older rules is never reused. Bump it with every change
# of a slicing rule (a refusal included: a cached slice skips the checks).
SLICE_RULES = 4
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
# Writing the derived GGUF (gguf.GGUFWriter)
# --------------------------------------------------------------------------


def _target_type(t: ReaderTensor, out_type: str) -> GGMLQuantizationType:
    if out_type == "keep" or t.tensor_type in _INT_TYPES:
        return t.tensor_type
    if out_type == "f16" and len(t.shape) == 1:
        return GGMLQuantizationType.F32  # norms and biases stay F32, as llama.cpp's converters do
    return _FLOAT_TARGET[out_type]


def _plan_tensors(reader: GGUFReader, src: Path, layers: Sequence[int], n_layer: int) -> list[tuple[str, ReaderTensor]]:
    """(output name, source tensor) in output order: the tensors before the
    first block, the blocks in ``layers`` order (renamed), the rest."""
    pre: list[ReaderTensor] = []
    post: list[ReaderTensor] = []
    blocks: dict[int, list[tuple[str, ReaderTensor]]] = {}
    for t in reader.tensors:
        m = _BLK_RE.match(t.name)
        if m:
            b = int(m.group(1))
            if b >= n_layer:
                raise ModelError(f"GGUF file {src} has tensor {t.name} but block_count is {n_layer}")
            blocks.setdefault(b, []).append((m.group(2), t))
        elif blocks:
            post.append(t)
        else:
            pre.append(t)
    out = [(t.name, t) for t in pre]
    for i, src_layer in enumerate(layers):
        out.extend((f"blk.{i}.{suffix}", t) for suffix, t in blocks.get(src_layer, []))
    out.extend((t.name, t) for t in post)
    return out


def field_types(reader: GGUFReader, key: str, src: Path) -> tuple[GGUFValueType, GGUFValueType | None]:
    """(value type, element type of an array else None) of metadata ``key``
    of ``reader`` (read from ``src``).

    Raises:
        ModelError: an array of arrays, which ggpipe cannot copy."""
    field = reader.fields[key]
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY and len(field.types) != 2:
        raise ModelError(f"GGUF file {src} has metadata {key} that is an array of arrays, which ggpipe cannot copy")
    return vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None


def add_field(writer: GGUFWriter, src: Path, key: str, value: Any, vtype: GGUFValueType,
              sub_type: GGUFValueType | None) -> None:
    """Write metadata ``key`` (copied from ``src``) with ``writer``.

    Raises:
        ModelError: an empty array, which the gguf package cannot write."""
    if vtype == GGUFValueType.ARRAY and not value:
        raise ModelError(
            f"GGUF file {src} has metadata {key} that is an empty array, which the gguf package cannot write"
        )
    writer.add_key_value(key, value, vtype, sub_type=sub_type)


def copy_fields(reader: GGUFReader, writer: GGUFWriter, src: Path, prefix: str) -> None:
    """Copy every metadata entry of ``reader`` whose key starts with ``prefix``
    (e.g. ``"tokenizer."``), in its order, types and values kept."""
    for key in reader.fields:
        if key.startswith(prefix):
            add_field(writer, src, key, field_value(reader, key, src), *field_types(reader, key, src))


def _copy_metadata(
    reader: GGUFReader, writer: GGUFWriter, src: Path, info: ModelInfo, layers: Sequence[int], out_type: str
) -> None:
    """Every metadata entry of ``reader``, in its order, into ``writer``:
    block_count and per-layer arrays re-indexed by ``layers``, the entries a
    slice needs (:func:`ggpipe.models.slicing.slice_metadata`) written or
    added, file_type set for f16/f32. The reader's virtual ``GGUF.*`` fields and
    general.architecture (the writer adds it itself) are skipped."""
    per_layer = set(info.per_layer_keys)
    extra = slice_metadata(reader, info.arch, info.n_layer, layers) if layers != list(range(info.n_layer)) else {}
    file_type = None
    if out_type != "keep":
        file_type = int(LlamaFileType.MOSTLY_F16 if out_type == "f16" else LlamaFileType.ALL_F32)
    for key in reader.fields:
        if key.startswith("GGUF.") or key == Keys.General.ARCHITECTURE:
            continue
        vtype, sub_type = field_types(reader, key, src)
        if key == Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(field_value(reader, key, src)))
            continue
        if key in extra:
            value, vtype, sub_type = extra.pop(key)
        elif key == f"{info.arch}.block_count":
            value: Any = len(layers)
        elif key == Keys.General.FILE_TYPE and file_type is not None:
            value, vtype = file_type, GGUFValueType.UINT32
        elif key in per_layer:
            values = field_value(reader, key, src)
            value = [values[i] for i in layers]
        else:
            value = field_value(reader, key, src)
        add_field(writer, src, key, value, vtype, sub_type)
    for key, (value, vtype, sub_type) in extra.items():  # what the slice needs beyond the source's entries
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if file_type is not None and Keys.General.FILE_TYPE not in reader.fields:
        writer.add_file_type(file_type)


def _converted(data: np.ndarray, qtype: GGMLQuantizationType, dtype: np.dtype) -> np.ndarray:
    return dequantize(data, qtype).astype(dtype, copy=False)


def _add_tensor(writer: GGUFWriter, src: Path, name: str, t: ReaderTensor, out_type: str) -> None:
    target = _target_type(t, out_type)
    if target == t.tensor_type:
        # Raw copy of the memory-mapped data; for quantized types the reader's
        # array has the byte shape, which the writer turns back into the
        # element shape.
        writer.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        return
    try:
        dequantize(t.data.reshape(-1, t.data.shape[-1])[:1], t.tensor_type)  # fail before writing anything
    except NotImplementedError:
        raise ModelError(
            f"cannot convert tensor {t.name} of {src.name} from {t.tensor_type.name}: "
            "the gguf package cannot dequantize that type; use type 'keep'"
        ) from None
    dtype = _NP_OF[target]
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    # Converted one tensor at a time, when the writer writes it.
    lazy = LazyNumpyTensor(
        meta=LazyNumpyTensor.meta_with_dtype_and_shape(dtype, shape),
        args=(t.data, t.tensor_type, dtype),
        func=_converted,
    )
    writer.add_tensor(name, lazy, raw_dtype=target)  # type: ignore[arg-type]


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
    read_model_info(src)  # a file GGUFReader could hang on is refused here, in a bounded child process
    reader = load_gguf(src, keep=True)  # kept open: deriving several files from one model parses it once
    info = info_from_reader(reader, src)
    n = info.n_layer
    bad = [x for x in layers if not 0 <= x < n]
    if bad:
        raise ModelError(f"layer {bad[0]} does not exist in {src.name}: it has layers 0-{n - 1}")
    if layers != list(range(n)):
        check_sliceable(info)
    if not out_path.parent.is_dir():
        raise ModelError(f"cannot write {out_path}: directory {out_path.parent} does not exist")

    def fill(writer: GGUFWriter) -> None:
        _copy_metadata(reader, writer, src, info, layers, out_type)
        for name, t in _plan_tensors(reader, src, layers, n):
            _add_tensor(writer, src, name, t, out_type)

    return write_gguf(out_path, info.arch, fill, progress, desc)


def write_gguf(out_path: Path, arch: str, fill: Callable[[GGUFWriter], None], progress: bool = False,
               desc: str | None = None, hash_progress: bool = False) -> tuple[Path, str]:
    """Write a GGUF of architecture ``arch`` whose metadata and tensors
    ``fill(writer)`` adds, under a temporary name in ``out_path``'s folder,
    hash it, then move it to ``out_path`` (a file with the final name is
    always complete). ``progress``: tqdm bars while writing (after the line
    ``desc``), and while hashing with ``hash_progress``. Returns
    (``out_path``, sha256 in hex).

    Raises:
        ModelError: the file cannot be written."""
    tmp = temp_path_for(out_path)
    writer = GGUFWriter(tmp, arch)
    try:
        fill(writer)
        if progress and desc:
            print(desc, file=sys.stderr, flush=True)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        sha = (sha256_file(tmp, progress=progress, desc=f"hashing {out_path.name}") if hash_progress
               else sha256_file(tmp))
        os.replace(tmp, out_path)
    except OSError as e:
        raise ModelError(f"cannot write {out_path}: {e.strerror or e}") from None
    finally:
        writer.close()
        remove_quietly(tmp)
    return out_path, sha


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


def _usable(path: Path, root: Path) -> bool:
    if not path.is_file():
        return False
    try:
        read_model_info(path, root)
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
    raw) cached as ``<cache_dir>/slices/<sha256[:16] of src>-<start>-<stop>-r<SLICE_RULES>.gguf``,
    built once; safe when several processes ask at the same time."""
    src = Path(src).expanduser()
    root = default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()
    info = read_model_info(src, root)
    n = info.n_layer
    if not (0 <= start < stop <= n):
        raise ModelError(f"layer range [{start}, {stop}) is not a non-empty range inside the {n} layers of {src.name}")
    if start == 0 and stop == n:
        return src
    check_sliceable(info)
    sha = cached_sha256(src, root)
    slices = ensure_dir(root / "slices")
    target = slices / f"{sha[:16]}-{start}-{stop}-r{SLICE_RULES}.gguf"
    if _usable(target, root):
        return target
    with file_lock(target.with_name(target.name + ".lock")):
        if not _usable(target, root):
            try:
                derive_gguf(src, range(start, stop), target, "keep")
            finally:
                release_kept()  # a rank keeps only its own slice mapped
    return target
