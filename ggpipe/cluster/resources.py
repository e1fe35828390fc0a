"""Resource requests checked before anything is allocated: the KV cache that
``-c`` asks of a rank against the memory it has, the context per sequence
against what the model was trained on, ``-t`` against the rank's CPUs
(unchecked, ``-c 100000000000`` grew the head to 12 GB until the kernel's
OOM killer ended it, and ``-t 1000`` started 1,003 threads per rank on
2 cores).

The KV cache of a stage is sized by ggpipe.models.kv_size (the one sizing
ggpipe plan and the simulator use too): per cell (token), the K and V rows of
each of the stage's layers that has a KV cache, as llama.cpp lays them out
for the model (head sizes, per-layer KV heads, MLA, recurrent layers), stored
in the cache types ``-ctk``/``-ctv`` (``ggml_row_size``), times the cells
llama.cpp allocates for ``-c`` (rounded up to 256). A lower bound: llama.cpp
adds compute buffers, and recurrent models' per-sequence state.
"""

from __future__ import annotations

import os
import sys

import psutil

from ggpipe.errors import ConfigError
from ggpipe.models import kv_size


def kv_bytes_per_cell(info, layers: int | tuple[int, int], type_k: str = "f16", type_v: str = "f16",
                      v_trans: bool = False) -> int:
    """KV cache bytes one cell (token) takes in a stage of the model
    ``info`` (a ggpipe.models.gguf_info.ModelInfo): its layers
    ``(start, stop)``, with K and V stored as ``type_k``/``type_v``
    (``-ctk``/``-ctv``; ``v_trans``: flash attention off), by
    :func:`ggpipe.models.kv_size.kv_bytes_per_cell`.

    ``layers`` may also be a count n without saying which layers: then the
    most any n consecutive layers of the model take (the same for every n
    layers of a model whose layers all have the same KV rows; an upper bound
    for a hybrid one, whose stages differ in how many attention layers they
    hold)."""
    layout = info.kv_layout
    if not isinstance(layers, int):
        return kv_size.kv_bytes_per_cell(layout, *layers, type_k, type_v, v_trans)
    n = min(layers, layout.n_layer)
    return max((kv_size.kv_bytes_per_cell(layout, a, a + n, type_k, type_v, v_trans)
                for a in range(layout.n_layer - n + 1)), default=0)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def check_kv_memory(n_ctx: int, parts: list[tuple], where: str, available: int | None = None) -> None:
    """Refuse a context whose KV cache cannot fit this rank's memory.

    Args:
        n_ctx: ``-c`` (llama.cpp allocates it rounded up to 256 cells).
        parts: (what, bytes per cell) of each stage this rank holds, e.g.
            ``[("target layers 0-14", 11520)]``, or (what, bytes per cell,
            cells) for a stage whose context is not ``-c`` (a draft model
            under ``--parallel``: one slot's cells).
        where: the rank, e.g. "rank 1 (node2)".
        available: bytes the rank may still use (default: psutil's
            ``virtual_memory().available``).

    Raises:
        ConfigError: the KV cache alone needs more than ``available`` bytes.
    """
    need = sum(kv_size.kv_cells(p[2] if len(p) > 2 else n_ctx) * p[1] for p in parts)
    free = psutil.virtual_memory().available if available is None else available
    if need > free:
        what = " and ".join(f"{p[0]}: {_size(p[1])} per cell"
                            + (f" x {kv_size.kv_cells(p[2])} cells" if len(p) > 2 else "") for p in parts)
        raise ConfigError(f"-c {n_ctx} needs {_size(need)} of KV cache on {where} ({what}), but only "
                          f"{_size(free)} of memory is available there: lower -c")


def context_warning(n_ctx_seq: int, n_ctx_train: int, model: str) -> str | None:
    """A warning when one sequence may hold more tokens than the model was
    trained on (llama.cpp warns the same: "n_ctx_seq > n_ctx_train"), else None."""
    if n_ctx_train > 0 and n_ctx_seq > n_ctx_train:
        return (f"a sequence may hold {n_ctx_seq} tokens, more than the {n_ctx_train} {model} was trained on: "
                f"text past {n_ctx_train} tokens may lose coherence (lower -c)")
    return None


def own_cpu_count() -> int:
    """The CPUs this process may use (``sched_getaffinity``; ``os.cpu_count``
    where the platform has no affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cap_threads(n_threads: int, where: str, cpus: int | None = None) -> tuple[int, str | None]:
    """``-t`` for this rank, at most its CPUs (``sched_getaffinity``):
    (threads to use, a warning or None). More threads than CPUs only make
    llama.cpp's threads wait for each other."""
    if cpus is None:
        cpus = own_cpu_count()
    if n_threads <= cpus:
        return n_threads, None
    return cpus, f"{where}: -t {n_threads} is more than the {cpus} CPUs it may use; using {cpus} threads"


# The longest sleep between a waiting rank's probes on a host whose ranks run more llama.cpp threads than it has
# CPUs (seconds). There a probe's wake-up takes the core of a stage that computes; elsewhere a waiting rank's own
# core is idle while it waits, and Transport.poll_max_s (100 us) keeps a hop's latency low.
# Measured with 3 ranks x 1 thread on a 2-core host: serve --parallel 8/16 +3-5%, batch +5%;
# at 2 ranks x 1 thread (threads = CPUs) it cost serve 9% and is not applied.
POLL_OVERSUBSCRIBED_S = 1e-3


def host_is_oversubscribed(hosts: list[str], rank: int, threads: list[int], cpus: list,
                           own_cpus: int | None = None) -> bool:
    """Whether the ranks that share CPUs with ``rank`` run more llama.cpp
    threads than those CPUs: then stages that compute at once
    (``--parallel``, PipeInfer) share cores, and a waiting rank that wakes
    to probe takes one of them. With threads = CPUs each stage has its own
    core, idle while its rank waits; ranks pinned to cores of their own
    (``-bind-to core``, a NUMA domain each) never wake on another's.

    Args:
        hosts: every rank's host name.
        threads: every rank's ``-t`` (:func:`ggpipe.cluster.config.parse_threads`),
            each counted at most the CPUs (:func:`cap_threads`).
        cpus: every rank's CPU affinity (CPU ids, or None where unknown):
            the ranks counted are those on ``rank``'s host whose CPUs
            overlap its own (all of them where either is unknown), the CPUs
            the union of theirs.
        own_cpus: the CPU count where no affinity is known (default: this
            process's, ``sched_getaffinity``).

    Example: 3 ranks x 1 thread, or 2 x 2, on CPUs {0, 1} -> True; 2 ranks
    x 1 thread on {0, 1}, 2 pinned to {0} and {1}, or one rank per host ->
    False.
    """
    mine = set(cpus[rank] or ())
    mates = [r for r, h in enumerate(hosts)
             if h == hosts[rank] and (not mine or not cpus[r] or mine & set(cpus[r]))]
    known = [set(cpus[r]) for r in mates if cpus[r]]
    if known:
        n = len(set().union(*known))
    elif own_cpus is not None:
        n = own_cpus
    else:
        n = own_cpu_count()
    return len(mates) > 1 and sum(min(threads[r], n) for r in mates) > n


def warn(message: str) -> None:
    """One ``ggpipe: warning:`` line on stderr."""
    sys.stderr.write(f"ggpipe: warning: {message}\n")
    sys.stderr.flush()
