"""Resource requests checked before anything is allocated: the KV cache that
``-c`` asks of a rank against the memory it has, the context per sequence
against what the model was trained on, ``-t`` against the rank's CPUs
(issue 29 item 13: ``-c 100000000000`` grew the head to 12 GB until the
kernel's OOM killer ended it; ``-t 1000`` started 1,003 threads per rank on
2 cores).

The KV cache of a stage holds, per cell (token) and layer, one key and one
value row of ``row = n_embd * n_head_kv / n_head`` values, stored in the
cache types ``-ctk``/``-ctv`` (llama.cpp's ``type_k``/``type_v``, f16 by
default; ``ggml_row_size``: a block-quantized type stores ``row / block``
blocks, q8_0 34 bytes per 32 values, q4_0 18), so

    bytes = n_ctx * n_layers * (row_size(type_k, row) + row_size(type_v, row))

(a lower bound: llama.cpp adds compute buffers, and rounds a stream's cells
up to 256).
"""

from __future__ import annotations

import os
import sys

import psutil

from ggpipe.errors import ConfigError
from ggpipe.runtime.llama import KV_CACHE_TYPES

def kv_row_bytes(cache_type: str, n_values: int) -> int:
    """Bytes of one KV row of ``n_values`` values in ``cache_type`` (ggml's
    ``ggml_row_size``: whole blocks of the type)."""
    _, block, size = KV_CACHE_TYPES[cache_type]
    return -(-n_values // block) * size


def kv_bytes_per_cell(info, n_layers: int, type_k: str = "f16", type_v: str = "f16") -> int:
    """KV cache bytes one cell (token) takes in ``n_layers`` layers of the
    model ``info`` (a ggpipe.models.gguf_info.ModelInfo), with K and V
    stored as ``type_k``/``type_v`` (``-ctk``/``-ctv``)."""
    n_head = info.n_head or 1
    n_head_kv = info.n_head_kv or n_head
    row = info.n_embd * n_head_kv // n_head
    return n_layers * (kv_row_bytes(type_k, row) + kv_row_bytes(type_v, row))


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def check_kv_memory(n_ctx: int, parts: list[tuple[str, int]], where: str, available: int | None = None) -> None:
    """Refuse a context whose KV cache cannot fit this rank's memory.

    Args:
        n_ctx: ``-c``, cells per stage.
        parts: (what, bytes per cell) of each stage this rank holds, e.g.
            ``[("target layers 0-14", 11520)]``.
        where: the rank, e.g. "rank 1 (node2)".
        available: bytes the rank may still use (default: psutil's
            ``virtual_memory().available``).

    Raises:
        ConfigError: the KV cache alone needs more than ``available`` bytes.
    """
    per_cell = sum(b for _, b in parts)
    need = n_ctx * per_cell
    free = psutil.virtual_memory().available if available is None else available
    if need > free:
        what = " and ".join(f"{w}: {_size(b)}" for w, b in parts)
        raise ConfigError(f"-c {n_ctx} needs {_size(need)} of KV cache on {where} ({what} per cell), but only "
                          f"{_size(free)} of memory is available there: lower -c")


def context_warning(n_ctx_seq: int, n_ctx_train: int, model: str) -> str | None:
    """A warning when one sequence may hold more tokens than the model was
    trained on (llama.cpp warns the same: "n_ctx_seq > n_ctx_train"), else None."""
    if n_ctx_train > 0 and n_ctx_seq > n_ctx_train:
        return (f"a sequence may hold {n_ctx_seq} tokens, more than the {n_ctx_train} {model} was trained on: "
                f"text past {n_ctx_train} tokens may lose coherence (lower -c)")
    return None


def cap_threads(n_threads: int, where: str, cpus: int | None = None) -> tuple[int, str | None]:
    """``-t`` for this rank, at most its CPUs (``sched_getaffinity``):
    (threads to use, a warning or None). More threads than CPUs only make
    llama.cpp's threads wait for each other."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n_threads <= cpus:
        return n_threads, None
    return cpus, f"{where}: -t {n_threads} is more than the {cpus} CPUs it may use; using {cpus} threads"


def warn(message: str) -> None:
    """One ``ggpipe: warning:`` line on stderr."""
    sys.stderr.write(f"ggpipe: warning: {message}\n")
    sys.stderr.flush()
