"""Resource requests checked before anything is allocated: the KV cache that
``-c`` asks of a rank against the memory it has, the context per sequence
against what the model was trained on, ``-t`` against the rank's CPUs
(issue 29 item 13: ``-c 100000000000`` grew the head to 12 GB until the
kernel's OOM killer ended it; ``-t 1000`` started 1,003 threads per rank on
2 cores).

The KV cache of a stage holds, per cell (token) and layer, one key and one
value row of ``n_embd * n_head_kv / n_head`` float16 values (llama.cpp's
default ``type_k``/``type_v``, ``llama_kv_cache``), so

    bytes = n_ctx * n_layers * 2 * 2 * n_embd * n_head_kv / n_head

(a lower bound: llama.cpp adds compute buffers, and rounds a stream's cells
up to 256).
"""

from __future__ import annotations

import os
import sys

import psutil

from ggpipe.errors import ConfigError

KV_BYTES_PER_VALUE = 2  # float16 K and V (llama.cpp's default cache types)


def kv_bytes_per_cell(info, n_layers: int) -> int:
    """KV cache bytes one cell (token) takes in ``n_layers`` layers of the
    model ``info`` (a ggpipe.models.gguf_info.ModelInfo)."""
    n_head = info.n_head or 1
    n_head_kv = info.n_head_kv or n_head
    row = info.n_embd * n_head_kv // n_head
    return n_layers * 2 * row * KV_BYTES_PER_VALUE


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
