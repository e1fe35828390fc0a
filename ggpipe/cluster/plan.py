"""``ggpipe plan``: what a job would run where, before running it.

Prints the launcher command and a rank -> host -> model/layers -> memory table:

* weights: the bytes of the tensors a rank's slice computes with (its
  ``blk.N.*`` tensors; the first stage adds ``token_embd``, the last stage
  ``output_norm`` and ``output``, or ``token_embd`` again when the model ties
  its output to it). Tensors a stage never touches stay unread pages of the
  mmapped slice and cost no memory.
* KV cache: the cells llama.cpp allocates for ``-c`` (rounded up to 256)
  x the bytes per cell of the slice's layers that have a KV cache, in the
  cache types ``-ctk``/``-ctv`` (ggpipe.models.kv_size: head sizes, per-layer
  KV heads, MLA, the recurrent layers of hybrid models). ggpipe's contexts
  use one unified KV buffer of ``n_ctx`` cells shared by every sequence, so
  ``--n-seq-max`` does not multiply it.
* not counted: llama.cpp's compute buffers and the last stage's logits
  buffer (n_batch x n_vocab x 4 bytes), typically tens of MB.

A model without its file, ``-m ARCH:QUANT`` or a described registry model
(models.toml ``shape``) not in the cache, is sized from its shape
(ggpipe.models.sizes.shape_sizes), with a warning that the job needs the file.

Ranks are placed on hosts the way the launcher would: from a hostfile
(Open MPI ``host slots=N`` or MPICH ``host:N`` lines) either round-robin one
rank per host (``--map-by node``) or filling each host's slots first
(``--map-by slot``); without a hostfile every rank is on this host. A warning
is printed when the ranks of a host need more memory than it has (this host:
psutil; other hosts: ``--mem-per-node``).
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ggpipe.errors import ConfigError, GGPipeError
from ggpipe.transport.launcher_path import find_launcher
from ggpipe.models.registry import DescribedModelError, resolve
from ggpipe.models.sizes import ModelSizes, model_sizes  # noqa: F401 (ggpipe plan's sizes)
from ggpipe.cluster.roles import Roles
from ggpipe.cluster.config import ClusterConfig, parse_threads
from ggpipe.cluster.split import parse_split
from ggpipe.cluster.loading import layer_ranges

# -- hosts -------------------------------------------------------------------------------


def parse_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """(host, slots) per line of an Open MPI (``host slots=N``) or MPICH
    (``host:N``) hostfile; a bare host has 1 slot; ``#`` starts a comment.

    Raises:
        ConfigError: unreadable, empty, or a line that is neither format.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read hostfile {p}: {getattr(e, 'strerror', None) or e}") from None
    hosts = []
    for i, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([\w.\-]+)(?::(\d+))?(?:\s+(?:slots|max_slots|max-slots)\s*=\s*(\d+))*\s*", line)
        if m is None:
            raise ConfigError(f"hostfile {p}:{i}: expected 'host', 'host slots=N' or 'host:N', got {line!r}")
        slots = int(m.group(2) or m.group(3) or 1)
        if slots < 1:
            raise ConfigError(f"hostfile {p}:{i}: slots must be at least 1")
        hosts.append((m.group(1), slots))
    if not hosts:
        raise ConfigError(f"hostfile {p} lists no hosts")
    return hosts


def place_ranks(n_ranks: int, hosts: list[tuple[str, int]] | None, map_by: str = "node") -> list[str]:
    """The host of each rank. ``node``: round-robin, one rank per host per
    round; ``slot``: fill each host's slots in order, then wrap around
    (oversubscribing). Without hosts every rank is on this host."""
    if not hosts:
        return [socket.gethostname()] * n_ranks
    if map_by == "node":
        return [hosts[r % len(hosts)][0] for r in range(n_ranks)]
    order = [h for h, slots in hosts for _ in range(slots)]
    return [order[r % len(order)] for r in range(n_ranks)]


def is_this_host(host: str) -> bool:
    """``host`` names the local host: its host name, the name's first label,
    ``localhost``, ``127.0.0.1`` or ``::1``."""
    me = socket.gethostname()
    return host in (me, me.split(".")[0], "localhost", "127.0.0.1", "::1")


def parse_bytes(text: str) -> int:
    """``64G``, ``512MiB``, ``1.5T``, ``123456`` (bytes; K/M/G/T are powers of 1024).

    Raises:
        ConfigError: not a size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ConfigError(f"--mem-per-node: expected a size such as 64G or 512M, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


# -- the plan -------------------------------------------------------------------------------


@dataclass
class RankPlan:
    """One rank of a :class:`Plan`: its host, the model it holds (``target``,
    ``draft``, or ``target+draft`` for a head that holds the whole draft), its
    layer range [start, stop) of ``n_layer`` layers (``draft_layers``: the
    draft's, on a head that holds the whole draft), threads, and the bytes of
    its weights and KV cache."""

    rank: int
    host: str
    model: str  # "target", "draft" or "target+draft" (the head holding the whole draft)
    layers: tuple[int, int]
    n_layer: int
    threads: int
    weights_bytes: int
    kv_bytes: int
    draft_layers: tuple[int, int] | None = None

    @property
    def total_bytes(self) -> int:
        """Weights and KV cache together (bytes)."""
        return self.weights_bytes + self.kv_bytes


@dataclass
class Plan:
    """What ``ggpipe plan`` shows: every rank's :class:`RankPlan`, the launch
    command, each host's memory (bytes, None where unknown), warnings, and,
    where asked for, the balanced split (``--balance``) and the ``--parallel``
    slots (slots, cells per slot, micro-batches in flight)."""

    ranks: list[RankPlan]
    command: list[str] = field(default_factory=list)
    host_memory: dict[str, int | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    balance: dict | None = None  # --balance: the chosen split and its predicted costs
    slots: dict | None = None    # batch/serve with --parallel > 1: slots, cells per slot, micro-batches in flight

    def host_totals(self) -> dict[str, int]:
        """Host -> bytes of weights and KV cache of all its ranks."""
        out: dict[str, int] = {}
        for r in self.ranks:
            out[r.host] = out.get(r.host, 0) + r.total_bytes
        return out

    def as_dict(self) -> dict:
        """The plan as JSON-ready data (``ggpipe plan --json``): ``command``,
        ``ranks`` (each with ``total_bytes``), ``hosts`` (their ranks,
        ``total_bytes`` and ``memory_bytes``), ``warnings``, and ``balance`` and
        ``slots`` where set."""
        return {"command": self.command, "ranks": [dict(asdict(r), total_bytes=r.total_bytes) for r in self.ranks],
                "hosts": {h: {"ranks": [r.rank for r in self.ranks if r.host == h], "total_bytes": t,
                              "memory_bytes": self.host_memory.get(h)} for h, t in self.host_totals().items()},
                "warnings": self.warnings, **({"balance": self.balance} if self.balance else {}),
                **({"slots": self.slots} if self.slots else {})}



def _ranges(sizes: ModelSizes, n_stages: int, weights, kind: str, known: dict,
            head: bool = True) -> list[tuple[int, int]]:
    """The layer ranges of a model's stages as the job computes them
    (:func:`ggpipe.cluster.loading.layer_ranges`), remembered in ``known``
    per model.

    Raises:
        ModelError: as the job would, when no default split avoids a refused stage."""
    key = (sizes.path, n_stages, weights, head)
    if key not in known:
        known[key] = layer_ranges(sizes, sizes.n_layer, n_stages, weights, kind, head=head)
    return known[key]


def plan_job(config: ClusterConfig, n_ranks: int, hosts: list[str], mem_per_node: int | None = None) -> Plan:
    """Rank layout and memory estimate of ``config`` on ``n_ranks`` ranks
    placed on ``hosts`` (one per rank).

    Raises:
        ConfigError, SplitError, ModelError: as the job itself would at start-up.
    """
    if config.ctx_size < 8:
        raise ConfigError("--ctx-size must be >= 8")
    config.check_cache_types()
    threads = parse_threads(config.threads, n_ranks)
    split = parse_split(config.split)
    names = config.draft_models
    roles = Roles.plan(n_ranks, split, bool(names), n_draft_models=len(names))
    target = model_sizes(config.model)
    drafts = [model_sizes(n) for n in names]
    draft = drafts[0] if drafts else None
    kv_opts = {"v_trans": config.flash_attn == "off", "n_seq_max": config.n_seq_max, "unified": config.kv_unified}
    d_ctx, d_seqs, d_unified = config.draft_context       # one slot's cells under --parallel (the job's)
    d_opts = {"v_trans": kv_opts["v_trans"], "n_seq_max": d_seqs, "unified": d_unified}
    out = []
    known: dict = {}
    for r in range(n_ranks):
        kind = roles.model_of(r)
        if kind == "target":
            sizes, weights = target, split.target
        else:
            k = roles.draft_of(r)
            sizes, weights = drafts[k], (split.drafts[k] if split.drafts else None)
        index, n_stages = roles.stage_of(r)
        start, stop = _ranges(sizes, n_stages, weights, kind, known, head=split.counts_head(kind))[index]
        first, last = index == 0, index == n_stages - 1
        w = sizes.slice_bytes(start, stop, first, last)
        types = (config.cache_type_k, config.cache_type_v) if kind == "target" else config.draft_cache_types
        kv = (sizes.kv_bytes(start, stop, config.ctx_size, *types, **kv_opts) if kind == "target"
              else sizes.kv_bytes(start, stop, d_ctx, *types, **d_opts))
        rp = RankPlan(r, hosts[r], kind, (start, stop), stop - start, threads[r], w, kv)
        if r == 0 and draft is not None and roles.n_draft == 0:  # the whole draft lives on the head
            rp.model = "target+draft"
            rp.draft_layers = (0, draft.n_layer)
            rp.weights_bytes += draft.slice_bytes(0, draft.n_layer, True, True)
            rp.kv_bytes += draft.kv_bytes(0, draft.n_layer, d_ctx, *config.draft_cache_types, **d_opts)
        out.append(rp)
    plan = Plan(out)
    for name, sizes in [(config.model, target), *zip(names, drafts)]:
        if sizes.shape is not None:
            plan.warnings.append(_shape_warning(name, sizes.shape))
    for host, total in plan.host_totals().items():
        mem = psutil.virtual_memory().total if is_this_host(host) else mem_per_node
        plan.host_memory[host] = mem
        if mem is not None and total > mem:
            ranks = ",".join(str(r.rank) for r in out if r.host == host)
            plan.warnings.append(f"host {host}: rank(s) {ranks} need about {fmt_bytes(total)} (weights + KV cache) "
                                 f"but it has {fmt_bytes(mem)} of memory: use more ranks/hosts, a smaller -c, "
                                 f"or a smaller model")
    return plan


def _shape_warning(name: str, shape: str) -> str:
    """What a plan of a model without its file says: it is sized from its
    shape, and the job itself needs the GGUF (where to get it, for a
    described registry model)."""
    try:
        resolve(name, fetch_missing=False)
    except DescribedModelError as e:
        return f"{e} (the job itself needs the file)"
    except GGPipeError:
        pass
    return (f"{name}: sized from its shape {shape} (no file); the job itself needs its GGUF: give its path "
            f"with -m when you run it")


def fmt_bytes(n: int | None) -> str:
    """``n`` bytes in binary units (``512 B``, ``1.5 KiB`` ... ``TiB``);
    ``?`` for None."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_table(plan: Plan) -> str:
    """The rank table and one line per host."""
    head = ("rank", "host", "model", "layers", "threads", "weights", "KV cache", "total")
    rows = []
    for r in plan.ranks:
        span = f"{r.layers[0]}-{r.layers[1] - 1}" if r.n_layer > 1 else f"{r.layers[0]}"
        if r.draft_layers is not None:
            span += f" + draft 0-{r.draft_layers[1] - 1}"
        rows.append((str(r.rank), r.host, r.model, span, str(r.threads), fmt_bytes(r.weights_bytes),
                     fmt_bytes(r.kv_bytes), fmt_bytes(r.total_bytes)))
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) for i in range(len(head))]
    right = {4, 5, 6, 7}

    def line(cells) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [line(head)] + [line(row) for row in rows]
    for host, total in plan.host_totals().items():
        n = sum(1 for r in plan.ranks if r.host == host)
        mem = plan.host_memory.get(host)
        has = f"of {fmt_bytes(mem)}" if mem is not None else "(memory unknown: give --mem-per-node)"
        lines.append(f"host {host}: {n} rank{'s' if n > 1 else ''}, {fmt_bytes(total)} {has}")
    if plan.slots:
        s = plan.slots
        how = "--micro-batches" if s["micro_batches_given"] else "one per target stage, at most 2 on a full host"
        lines.append(f"--parallel {s['slots']}: {s['slots']} slots of {s['cells_per_slot']} KV cells, "
                     f"{s['micro_batches']} micro-batches in flight ({how})")
    lines.append("not counted: llama.cpp compute buffers and the last stage's logits buffer (tens of MB)")
    return "\n".join(lines)


# -- launcher commands ---------------------------------------------------------------------------


def detect_flavor(mpiexec: str = "mpiexec") -> str:
    """"openmpi", "mpich" (MPICH, Intel MPI, MVAPICH: Hydra) or "unknown", from ``mpiexec --version``."""
    try:
        exe = find_launcher(mpiexec)
    except ConfigError:
        return "unknown"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if re.search(r"Open MPI|OpenRTE|open-mpi\.org", out):
        return "openmpi"
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI", out):
        return "mpich"
    return "unknown"


def launcher_command(flavor: str, n_ranks: int, hostfile: str | None, map_by: str, bind_to: str,
                     threads: int) -> list[str]:
    """The launcher's part of the command line (before ``ggpipe ...``).

    ``map_by`` node|slot; ``bind_to`` none|core|socket|numa; with core
    binding each rank gets ``threads`` cores (Open MPI ``PE=``, Hydra
    ``core:N``) rather than one core for all its threads.
    """
    if flavor == "srun":
        cmd = ["srun", "-n", str(n_ranks), f"--cpus-per-task={threads}"]
        if map_by == "node":
            cmd.append("--ntasks-per-node=1")
        cmd.append(f"--cpu-bind={'none' if bind_to == 'none' else {'core': 'cores', 'socket': 'sockets', 'numa': 'ldoms'}[bind_to]}")
        return cmd
    cmd = ["mpiexec", "-n", str(n_ranks)]
    if flavor == "openmpi":
        if hostfile:
            cmd += ["--hostfile", hostfile]
        mapping = map_by + (f":PE={threads}" if bind_to == "core" and threads > 1 else "")
        cmd += ["--map-by", mapping, "--bind-to", bind_to]
        return cmd
    # MPICH / Hydra (also the default when the flavor is unknown): survivors of a dead
    # rank get SIGUSR1 instead of SIGKILL, so ggpipe can name it (transport/liveness.py)
    cmd.append("-disable-auto-cleanup")
    if hostfile:
        cmd += ["-f", hostfile]
        if map_by == "node":
            cmd += ["-ppn", "1"]
    if bind_to != "none":
        cmd += ["-bind-to", f"core:{threads}" if bind_to == "core" and threads > 1 else bind_to]
    return cmd


def shell_join(args: list[str]) -> str:
    """``args`` as one shell command line, each quoted where needed
    (:func:`shlex.join`)."""
    return shlex.join(args)


def slot_summary(plan: Plan, config: ClusterConfig, micro_batches: int | None) -> dict:
    """What a batch/serve job of ``config``'s ``--parallel`` slots runs: its
    slots, each slot's KV cells (``ClusterConfig.slot_cells``) and the
    micro-batches the scheduler keeps in flight
    (``micro_batches`` given, or what ``auto`` makes of the target ranks'
    hosts and threads, :func:`concurrent_stages`; on this machine the CPUs
    it may use, elsewhere every stage counted as able to run)."""
    here = {socket.gethostname(), "localhost", "127.0.0.1"}
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    target = [r for r in plan.ranks if "target" in r.model]
    auto = concurrent_stages([r.host for r in target], [mine if r.host in here else None for r in target],
                             [r.threads for r in target])
    return {"slots": config.n_seq_max, "cells_per_slot": config.slot_cells,
            "micro_batches": micro_batches or auto, "micro_batches_given": micro_batches is not None}


def concurrent_stages(hosts: list[str], cpus: list, threads: list[int]) -> int:
    """How many of a pipeline's stages can compute at the same time: per
    host, its stages, but no more than its CPUs (the union of the ranks' CPU
    affinity there) hold of their threads; summed over the hosts. A rank of
    unknown affinity counts as a stage of its own. One entry per stage in
    each list: its host, its CPU ids (or None), its threads. The scheduler's
    default micro-batches in flight (``--micro-batches auto``).

    Example: three stages of one thread on a host of 2 CPUs -> 2; on three
    hosts -> 3; four stages of 4 threads on 16 CPUs -> 4; two stages of 4
    threads on 4 CPUs -> 1.

    Measured (docs/benchmarks/batching.md, On a 16-core host): 4 ranks x 4
    threads on one 16-core host, 16 requests, made 1.2-2.2x the rows per
    second with 4 micro-batches as with 2, pinned (``-bind-to core:4``) or
    not."""
    by_host: dict[str, list[int]] = {}
    for i, h in enumerate(hosts):
        by_host.setdefault(h, []).append(i)
    total = 0
    for stages in by_host.values():
        known = [set(cpus[i]) for i in stages if cpus[i]]
        n = len(stages)
        if len(known) == len(stages):
            n_cpus = len(set().union(*known))
            n = min(n, max(1, n_cpus // max(1, max(threads[i] for i in stages))))
        total += n
    return max(1, total)

