"""Bringing up a job: who is which stage, loading every rank's slice, and
tearing down. Shared by every mode and front end.

Start-up, under ``mpiexec -n R`` (rank 0 is the head):

  1. HELLO   every worker sends {config digest, host, pid} to the head; the
             head refuses ranks started with different arguments.
  2. GO      head -> workers: go on (with every rank's host) or stop.
  3. load    every rank resolves the model, plans the layer split, cuts its
             slice (cached) and loads it into llama.cpp.
  4. READY   worker -> head: loaded, or the error it hit.
  5. GO      head -> workers: serve, or stop (an error anywhere stops all,
             and the head prints the first one, naming the rank).

Every wait is bounded (``load_timeout_s``). Without an MPI launcher the job
is a single process holding the whole model (no MPI library needed).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, field

from ggpipe.errors import ConfigError, GGPipeError, RankFailedError
from ggpipe.metrics import MemorySampler, rank_info
from ggpipe.models.derive import stage_slice
from ggpipe.models.gguf_info import read_model_info
from ggpipe.models.registry import cache_dir, resolve
from ggpipe.runtime.stage import Stage, StageSpec
from ggpipe.scheduling.pipeline import Pipeline
from ggpipe.scheduling.split import parse_split, plan_layers
from ggpipe.transport import messages as m
from ggpipe.transport.mpi import Transport, mpi_world


@dataclass(frozen=True)
class ClusterConfig:
    """Settings every rank must share (their digest is compared at start-up).

    Attributes:
        model: registry name or GGUF path.
        split: ``--split`` text (PipeInfer syntax), or None for an even split.
        threads: ``-t``: one thread count for every rank, or one per rank
            ("2,1,1").
        ctx_size: KV cache cells per stage (tokens).
        n_seq_max: KV sequence ids per context (1..256).
        ubatch: tokens per micro-batch (n_batch = n_ubatch).
        timeout_s: bound of every wait inside a transaction, seconds.
        idle_timeout_s: bound of a worker's wait between transactions.
        load_timeout_s: bound of start-up waits (fetching, slicing, loading).
    """

    model: str
    split: str | None = None
    threads: str = "1"
    ctx_size: int = 2048
    n_seq_max: int = 1
    ubatch: int = 512
    timeout_s: float = 60.0
    idle_timeout_s: float = 3600.0
    load_timeout_s: float = 900.0

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def parse_threads(text: str, n_ranks: int) -> list[int]:
    """``-t`` value -> threads per rank.

    Raises:
        ConfigError: not positive integers, or a list of the wrong length.
    """
    try:
        vals = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"-t must be a thread count or a comma-separated list, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise ConfigError(f"-t: thread counts must be at least 1, got {text!r}")
    if len(vals) == 1:
        return vals * n_ranks
    if len(vals) != n_ranks:
        raise ConfigError(f"-t lists {len(vals)} thread counts but the job has {n_ranks} ranks")
    return vals


@dataclass
class Session:
    """One rank's view of the running job."""

    config: ClusterConfig
    rank: int
    size: int
    transport: Transport | None
    stage: Stage
    layers: tuple[int, int]
    n_layer_total: int
    model_path: str
    hosts: list[str]
    memory: MemorySampler
    pipeline: Pipeline | None = None     # head only
    ranks_layers: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    def rank_stats(self) -> dict:
        info = rank_info(self.rank)
        info.update(layers=list(self.layers), threads=self.stage.spec.n_threads, **self.memory.report())
        return info

    def serve(self) -> None:
        """Worker ranks: serve the pipeline until the head shuts it down, then
        send this rank's statistics to the head."""
        from ggpipe.scheduling.worker import Worker  # noqa: PLC0415

        nxt = self.rank + 1 if self.rank + 1 < self.size else None
        w = Worker(self.stage, self.transport, self.rank - 1, nxt, 0, self.config.ubatch)
        stats = w.serve(self.config.idle_timeout_s)
        out = self.rank_stats()
        out.update(stats)
        self.transport.send_obj(0, m.T_STATS, out)
        self.transport.flush(self.config.timeout_s)

    def shutdown(self) -> list[dict]:
        """Head: stop every worker and collect per-rank statistics (rank order)."""
        stats = [dict(self.rank_stats(), busy_s=self.pipeline.busy_s if self.pipeline else 0.0)]
        if self.transport is not None and self.size > 1:
            self.transport.send(1, m.T_SHUTDOWN, m.encode_simple(m.T_SHUTDOWN))
            for r in range(1, self.size):
                stats.append(self.transport.recv_obj(r, m.T_STATS, "its statistics at shutdown", self.config.timeout_s))
            self.transport.flush(self.config.timeout_s)
        return stats

    def close(self) -> None:
        self.memory.stop()
        self.stage.close()


def _exchange(t: Transport, rank: int, size: int, payload: dict, what: str, timeout_s: float):
    """Worker: send ``payload`` to the head and wait for its verdict. Head:
    collect every worker's payload. Returns the list (head) or verdict (worker)."""
    if rank == 0:
        return [payload] + [t.recv_obj(r, m.T_HELLO if what == "hello" else m.T_READY, f"its {what}", timeout_s)
                            for r in range(1, size)]
    t.send_obj(0, m.T_HELLO if what == "hello" else m.T_READY, payload)
    return t.recv_obj(0, m.T_GO, f"the head's answer to {what}", timeout_s)


def _verdict(t: Transport, size: int, error: str | None, extra: dict | None = None) -> None:
    for r in range(1, size):
        t.send_obj(r, m.T_GO, dict(ok=error is None, error=error, **(extra or {})))
    t.flush(10.0)


def open_session(config: ClusterConfig, argv: list[str] | None = None) -> Session:
    """Bring up this rank (see the module docstring). ``argv`` (default
    ``sys.argv[1:]``) must be the same on every rank: its digest, with the
    config's, is compared at start-up.

    Raises:
        GGPipeError: on the head, the first error of any rank (naming it).
        RankFailedError: on a worker, when the job stops because of an error
            the head reports.
    """
    world = mpi_world()
    if world is None:
        rank, size, transport, hosts = 0, 1, None, [socket.gethostname()]
    else:
        comm, rank, size = world
        transport = Transport(comm, timeout_s=config.timeout_s)
        args = sys.argv[1:] if argv is None else argv
        digest = hashlib.sha256((config.digest() + json.dumps(list(args))).encode()).hexdigest()[:16]
        hello = {"digest": digest, "host": socket.gethostname(), "pid": os.getpid()}
        got = _exchange(transport, rank, size, hello, "hello", config.load_timeout_s)
        if rank == 0:
            hosts = [h["host"] for h in got]
            bad = [r for r, h in enumerate(got) if h["digest"] != hello["digest"]]
            err = None
            if bad:
                err = (f"rank {bad[0]} ({hosts[bad[0]]}) was started with different arguments than rank 0: "
                       f"start every rank with the same ggpipe command")
            _verdict(transport, size, err, {"hosts": hosts})
            if err:
                raise ConfigError(err)
        else:
            if not got["ok"]:
                raise RankFailedError(got["error"])
            hosts = got["hosts"]
        transport.hosts = hosts

    memory = MemorySampler().start()
    err, loaded = None, None
    try:
        loaded = _load(config, rank, size)
    except GGPipeError as exc:
        err = str(exc)
    if transport is not None:
        got = _exchange(transport, rank, size, {"ok": err is None, "error": err}, "ready", config.load_timeout_s)
        if rank == 0:
            first = err and (0, err) or next(((r, g["error"]) for r, g in enumerate(got) if not g["ok"]), None)
            msg = None
            if first:
                r, e = first
                msg = e if (r == 0 or e == err) else f"{transport.name(r)}: {e}"
            _verdict(transport, size, msg)
            if msg:
                _close_loaded(loaded)
                raise GGPipeError(msg)
        elif not got["ok"]:
            _close_loaded(loaded)
            raise RankFailedError(got["error"])
    elif err:
        raise GGPipeError(err)

    stage, layers, plan, n_layer, path = loaded
    s = Session(config, rank, size, transport, stage, layers, n_layer, path, hosts, memory, ranks_layers=plan)
    if rank == 0:
        s.pipeline = Pipeline(stage, transport, list(range(1, size)), stage.n_vocab, config.n_seq_max,
                              max_outputs=config.ubatch)
    return s


def _close_loaded(loaded) -> None:
    if loaded is not None:
        loaded[0].close()


def _load(config: ClusterConfig, rank: int, size: int):
    if not 1 <= config.n_seq_max <= 256:
        raise ConfigError(f"--n-seq-max must be 1..256 (llama.cpp's LLAMA_MAX_SEQ), got {config.n_seq_max}")
    if config.ubatch < 1 or config.ctx_size < 8:
        raise ConfigError("--ubatch must be >= 1 and --ctx-size >= 8")
    threads = parse_threads(config.threads, size)
    path = resolve(config.model)
    info = read_model_info(path)
    spec = parse_split(config.split)
    if spec.draft is not None:
        raise ConfigError("a '/' draft split needs a draft model (-md), which this mode does not use")
    plan = plan_layers(info.n_layer, size, spec.target)
    start, stop = plan[rank]
    slice_path = stage_slice(path, start, stop, cache_dir())
    stage = Stage(StageSpec(
        model_path=slice_path, n_layer=stop - start, first=rank == 0, last=rank == size - 1,
        n_ctx=config.ctx_size, n_threads=threads[rank], n_seq_max=config.n_seq_max, n_ubatch=config.ubatch,
    ))
    return stage, (start, stop), plan, info.n_layer, str(path)
