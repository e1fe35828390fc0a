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

Every wait is bounded: HELLO by ``GGPIPE_INIT_TIMEOUT`` (30 s: MPI_Init
synchronises the processes and each sends HELLO right after it), the others
by ``load_timeout_s``. Without an MPI launcher the job
is a single process holding the whole model (no MPI library needed).

A rank that fails before it reaches step 1 (a usage error, a bad option
value: :func:`report_startup_error`) still initialises MPI and sends a HELLO
carrying its error instead of a digest, so the job meets, the head prints one
line naming that rank, and every rank exits within seconds. Without it the
other ranks would wait inside ``MPI_Init`` for a process that never comes.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass, field

from ggpipe.errors import ConfigError, GGPipeError, RankFailedError, RankTimeoutError
from ggpipe.metrics import MemorySampler, rank_info
from ggpipe.models.derive import stage_slice
from ggpipe.models.gguf_info import read_model_info
from ggpipe.models.registry import cache_dir, resolve
from ggpipe.runtime.stage import Stage, StageSpec
from ggpipe.pipeline.driver import Pipeline
from ggpipe.cluster.roles import Roles
from ggpipe.cluster.split import parse_split, plan_layers
from ggpipe.transport import messages as m
from ggpipe.transport import rank_guard
from ggpipe.transport.init_watchdog import init_timeout_s
from ggpipe.transport.launcher_signal import check_launcher_signal
from ggpipe.transport.mpi import Transport, mpi_world, thread_level_problem


@dataclass(frozen=True)
class ClusterConfig:
    """Settings every rank must share (their digest is compared at start-up).

    Attributes:
        model: registry name or GGUF path of the target model.
        draft_model: the draft model (speculation modes), or None; several
            draft models, each on ranks of its own, for a vote: comma-separated
            (``-md a,b``; :attr:`draft_models`).
        split: ``--split`` text (PipeInfer syntax), or None for an even split.
        threads: ``-t``: one thread count for every rank, or one per rank
            ("2,1,1").
        ctx_size: KV cache cells per stage (tokens).
        n_seq_max: KV sequence ids per context (1..256).
        ubatch: tokens per micro-batch (n_batch = n_ubatch).
        timeout_s: bound of every wait inside a transaction, seconds.
        load_timeout_s: bound of start-up waits (fetching, slicing, loading).
        liveness_timeout_s: heartbeat silence after which a rank counts as
            dead or stuck and the job is stopped (ggpipe.transport.liveness);
            it also bounds a worker's wait between transactions, which has no
            time-out of its own (a chat or server may idle for days).
        flash_attn: ``-fa``: "off" (the exactness reference), "on", "auto".
        kv_unified: one KV buffer for every sequence (the speculative modes'
            partitions need it); False: one KV stream per sequence, of
            ``ctx_size / n_seq_max`` cells (``--parallel`` slots: a slot's
            cells never sit among another's).
    """

    model: str
    draft_model: str | None = None
    split: str | None = None
    threads: str = "1"
    ctx_size: int = 2048
    n_seq_max: int = 1
    ubatch: int = 512
    timeout_s: float = 60.0
    load_timeout_s: float = 900.0
    liveness_timeout_s: float = 6.0
    flash_attn: str = "off"
    kv_unified: bool = True

    @property
    def draft_models(self) -> list[str]:
        """The draft models in ``-md`` order ([] for none)."""
        if self.draft_model is None:
            return []
        return [m.strip() for m in self.draft_model.split(",")]

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


class Activity:
    """What the job is doing, for error messages ("generating (token 12)").
    The head updates it; the liveness thread reads it."""

    def __init__(self, doing: str = "starting up"):
        self.set(doing)

    def set(self, doing: str, clock=None) -> None:
        """``clock``: a GenerationClock while a request runs."""
        self.doing, self.clock = doing, clock
        rank_guard.set_doing(doing)  # what this rank's guard says if the rank dies

    def __str__(self) -> str:
        c = self.clock
        if c is None:
            return self.doing
        if c.t_prompt_done is None:
            return f"{self.doing}: processing the prompt"
        return f"{self.doing}: generating (token {c.n_tokens + 1})"


@dataclass
class Session:
    """One rank's view of the running job."""

    config: ClusterConfig
    rank: int
    size: int
    transport: Transport | None
    stage: Stage
    layers: tuple[int, int]
    model_path: str
    hosts: list[str]
    memory: MemorySampler
    roles: Roles
    pipeline: Pipeline | None = None        # head only: the target pipeline
    draft_pipelines: list[Pipeline] = field(default_factory=list)  # head only: one per draft model
    draft_stage: Stage | None = None        # head only, when no rank runs the draft
    liveness: object = None                 # ggpipe.transport.liveness.Liveness (MPI jobs)
    activity: Activity | None = None

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    def rank_stats(self) -> dict:
        info = rank_info(self.rank)
        info.update(model=self.roles.model_of(self.rank), layers=list(self.layers),
                    threads=self.stage.spec.n_threads, **self.memory.report())
        return info

    def serve(self) -> None:
        """Worker ranks: serve the pipeline until the head shuts it down, then
        send this rank's statistics to the head."""
        from ggpipe.pipeline.worker import Worker  # noqa: PLC0415

        w = Worker(self.stage, self.transport, max_tokens=self.config.ubatch, **self.roles.links(self.rank))
        if self.activity is not None:
            self.activity.set(f"serving {_role(self.roles, self.rank, self.layers)}")
        stats = w.serve()  # between transactions, as long as the head's heartbeats come
        self.stop_liveness()  # leaving normally: the head stops watching this rank
        out = self.rank_stats()
        out.update(stats)
        self.transport.send_obj(0, m.T_STATS, out)
        self.transport.flush(self.config.timeout_s)

    def shutdown(self) -> list[dict]:
        """Head: stop every worker and collect per-rank statistics (rank order)."""
        if self.activity is not None:
            self.activity.set("shutting down")
        for p in (self.pipeline, *self.draft_pipelines):
            if p is not None:
                p.close()
        head = dict(self.rank_stats(), busy_s=self.pipeline.busy_s if self.pipeline else 0.0)
        if self.pipeline is not None:
            head.update(self.pipeline.stats)
        stats = [head]
        if self.transport is not None and self.size > 1:
            firsts = [1] if self.roles.n_target > 1 else []
            firsts += [self.roles.draft_ranks_of(k)[0] for k, n in enumerate(self.roles.drafts) if n]
            for r in firsts:
                self.transport.send(r, m.T_SHUTDOWN, m.encode_simple(m.T_SHUTDOWN))
            for r in range(1, self.size):
                stats.append(self.transport.recv_obj(r, m.T_STATS, "its statistics at shutdown", self.config.timeout_s))
            self.transport.flush(self.config.timeout_s)
        self.stop_liveness()
        return stats

    def stop_liveness(self) -> None:
        """Stop the heartbeats, telling the peers this rank leaves normally."""
        if self.liveness is not None:
            self.liveness.stop(leaving=True)

    def close(self) -> None:
        if self.liveness is not None:  # leaving; the peers' last heartbeats received before MPI_Finalize
            self.liveness.close()
        self.memory.stop()
        self.stage.close()
        if self.draft_stage is not None:
            self.draft_stage.close()


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


_startup = {"entered": False}  # open_session has begun meeting the other ranks


def startup_entered() -> bool:
    """True once this process has begun the start-up exchange (HELLO)."""
    return _startup["entered"]


def enter_startup() -> None:
    """This process meets the other ranks by other means than
    :func:`open_session` (``ggpipe calibrate``): an error from now on ends
    the job (MPI_Abort) instead of being carried by a HELLO."""
    _startup["entered"] = True


def report_startup_error(message: str, timeout_s: float | None = None) -> str | None:
    """Meet the other ranks with an error instead of a HELLO (see the module
    docstring) and return the line this rank should print: on the head, the
    first error of any rank, named (its own first); on a worker, None when
    the head answered (the head prints it), else its own error naming its
    rank. Without an MPI launcher, or in a job of one rank: ``message``.

    Every wait is bounded by ``timeout_s`` seconds (default
    ``GGPIPE_INIT_TIMEOUT``, 30 s; it ends early when the launcher signals
    that another rank has ended).
    """
    if _startup["entered"]:
        return message
    _startup["entered"] = True
    timeout_s = init_timeout_s() if timeout_s is None else timeout_s
    try:
        world = mpi_world()
    except Exception:  # noqa: BLE001 - no MPI library: report locally
        return message
    if world is None or world[2] == 1:
        return message
    comm, rank, size = world
    transport = Transport(comm, timeout_s=timeout_s)
    transport.interrupt = check_launcher_signal
    me = rank_info(rank)
    hello = {"digest": None, "error": message, "host": me["host"], "pid": me["pid"], "cpus": None}
    try:
        got = _exchange(transport, rank, size, hello, "hello", timeout_s)
    except GGPipeError as exc:
        return message if rank == 0 else f"rank {rank} ({me['host']}): {message} (and then: {exc})"
    if rank == 0:
        _verdict(transport, size, message, {"hosts": [g["host"] for g in got], "pids": [g["pid"] for g in got]})
        return message
    return None


def _first_error(got: list[dict]) -> str | None:
    """The first error a HELLO carries (rank order), named by rank and host."""
    for r, h in enumerate(got):
        if h.get("error"):
            return h["error"] if r == 0 else f"rank {r} ({h['host']}): {h['error']}"
    return None


def open_session(config: ClusterConfig, argv: list[str] | None = None, async_head: bool = False) -> Session:
    """Bring up this rank (see the module docstring). ``argv`` (default
    ``sys.argv[1:]``) must be the same on every rank: its digest, with the
    config's, is compared at start-up. ``async_head``: run the head's target
    stage on an executor thread (speculation modes).

    Raises:
        GGPipeError: on the head, the first error of any rank (naming it).
        RankFailedError: on a worker, when the job stops because of an error
            the head reports.
    """
    world = mpi_world()
    described: dict[int, str] = {}  # rank -> its model and layers, once loaded
    if world is None:
        rank, size, transport, hosts = 0, 1, None, [socket.gethostname()]
    else:
        comm, rank, size = world
        _startup["entered"] = True
        transport = Transport(comm, timeout_s=config.timeout_s)
        args = sys.argv[1:] if argv is None else argv
        digest = hashlib.sha256((config.digest() + json.dumps(list(args))).encode()).hexdigest()[:16]
        me = rank_info(rank)
        hello = {"digest": digest, "host": me["host"], "pid": me["pid"], "cpus": me["cpu_affinity"],
                 "error": thread_level_problem()}
        transport.interrupt = check_launcher_signal  # a rank that ends before the heartbeats start
        # MPI_Init synchronises the processes, and each sends its HELLO right after it: a rank that has
        # not done so within the start-up bound is not a ggpipe rank of this job, or has ended
        try:
            got = _exchange(transport, rank, size, hello, "hello", init_timeout_s())
        except RankTimeoutError as exc:
            raise RankTimeoutError(f"{exc.waited_for}: that rank did not start a ggpipe job within "
                                   f"{init_timeout_s():g} s of MPI start-up: it runs another command, or it ended "
                                   f"(its own output says which; GGPIPE_INIT_TIMEOUT sets the limit)") from None
        if rank == 0:
            hosts = [h["host"] for h in got]
            if os.environ.get("GGPIPE_VERBOSE"):
                for r, h in enumerate(got):
                    sys.stderr.write(f"ggpipe: rank {r}: host {h['host']}, pid {h['pid']}, "
                                     f"CPU affinity {_cpu_list(h['cpus'])}\n")
            bad = [r for r, h in enumerate(got) if h["digest"] != hello["digest"]]
            err = _first_error(got)
            if bad and err is None:
                err = (f"rank {bad[0]} ({hosts[bad[0]]}) was started with different arguments than rank 0: "
                       f"start every rank with the same ggpipe command")
            _verdict(transport, size, err, {"hosts": hosts, "pids": [h["pid"] for h in got]})
            if err:
                raise ConfigError(err)
        else:
            if not got["ok"]:
                raise RankFailedError(got["error"])
            hosts = got["hosts"]
        transport.hosts = hosts
        pids = [h["pid"] for h in got] if rank == 0 else got["pids"]

    activity = Activity("loading the model")
    liveness = None
    if transport is not None:
        liveness = _start_liveness(transport, config, rank, size, hosts, pids, activity, described)
        transport.interrupt = None

    memory = MemorySampler().start()
    err, loaded = None, None
    try:
        loaded = _load(config, rank, size)
    except GGPipeError as exc:
        err = str(exc)
    role = None if loaded is None else _role(loaded.roles, rank, loaded.layers)
    if role is not None:
        rank_guard.set_role(role)
    if transport is not None:
        got = _exchange(transport, rank, size, {"ok": err is None, "error": err, "role": role}, "ready",
                        config.load_timeout_s)
        if rank == 0:
            described.update({r: g.get("role") for r, g in enumerate(got) if g.get("role")})
            first = err and (0, err) or next(((r, g["error"]) for r, g in enumerate(got) if not g["ok"]), None)
            msg = None
            if first:
                r, e = first
                msg = e if (r == 0 or e == err) else f"{transport.name(r)}: {e}"
            _verdict(transport, size, msg)
            if msg:
                liveness.close()
                _close_loaded(loaded)
                raise GGPipeError(msg)
        elif not got["ok"]:
            liveness.close()
            _close_loaded(loaded)
            raise RankFailedError(got["error"])
    elif err:
        raise GGPipeError(err)

    activity.set("idle")
    s = Session(config, rank, size, transport, loaded.stage, loaded.layers, loaded.path, hosts,
                memory, loaded.roles, draft_stage=loaded.draft_stage, liveness=liveness, activity=activity)
    if rank == 0:
        roles = loaded.roles
        s.pipeline = Pipeline(loaded.stage, transport, roles.target_ranks, loaded.stage.n_vocab,
                              config.n_seq_max, max_outputs=config.ubatch, async_local=async_head, name="target")
        for k in range(len(roles.drafts)):
            s.draft_pipelines.append(Pipeline(loaded.draft_stage, transport, roles.draft_ranks_of(k),
                                              loaded.stage.n_vocab, config.n_seq_max, max_outputs=config.ubatch,
                                              name=roles.draft_name(k)))
    return s


def _role(roles: Roles, rank: int, layers: tuple[int, int]) -> str:
    """A rank's model and layer range (inclusive), e.g. "target layers 14-26"."""
    return f"{roles.model_of(rank)} layers {layers[0]}-{layers[1] - 1}"


def _cpu_list(cpus: list[int] | None) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    if not cpus:
        return "unknown"
    out, start = [], cpus[0]
    for a, b in zip(cpus, cpus[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(out)


def _start_liveness(transport: Transport, config: ClusterConfig, rank: int, size: int, hosts: list[str],
                    pids: list[int], activity: Activity, described: dict[int, str]):
    """Heartbeats head <-> workers (collective: every rank calls it after HELLO)."""
    from ggpipe.transport.liveness import Liveness

    def describe(r: int) -> str:
        role = described.get(r)
        who = "the head, rank 0" if r == 0 else f"rank {r}"
        return f"{who} ({hosts[r]}, pid {pids[r]}{', ' + role if role else ''})"

    peers = list(range(1, size)) if rank == 0 else [0]
    return Liveness(transport.comm, peers, config.liveness_timeout_s, describe,
                    lambda r: (hosts[r], pids[r]), lambda: str(activity)).start()


def _close_loaded(loaded) -> None:
    if loaded is not None:
        loaded.stage.close()
        if loaded.draft_stage is not None:
            loaded.draft_stage.close()


@dataclass
class _Loaded:
    stage: Stage
    layers: tuple[int, int]
    path: str
    roles: Roles
    draft_stage: Stage | None = None


def _load(config: ClusterConfig, rank: int, size: int) -> _Loaded:
    if not 1 <= config.n_seq_max <= 256:
        raise ConfigError(f"--n-seq-max must be 1..256 (llama.cpp's LLAMA_MAX_SEQ), got {config.n_seq_max}")
    if config.ubatch < 1 or config.ctx_size < 8:
        raise ConfigError("--ubatch must be >= 1 and --ctx-size >= 8")
    threads = parse_threads(config.threads, size)
    split = parse_split(config.split)
    names = config.draft_models
    roles = Roles.plan(size, split, bool(names), n_draft_models=len(names))
    path = resolve(config.model)
    info = read_model_info(path)
    drafts = []
    for name in names:
        d_path = resolve(name)
        d_info = read_model_info(d_path)
        check_same_vocab(info, d_info)
        drafts.append((d_path, d_info))
    draft_path, draft_info = drafts[0] if drafts else (None, None)

    model = roles.model_of(rank)
    if model == "target":
        m_path, m_info, weights = path, info, split.target
    else:
        k = roles.draft_of(rank)
        (m_path, m_info), weights = drafts[k], (split.drafts[k] if split.drafts else None)
    index, n_stages = roles.stage_of(rank)
    plan = plan_layers(m_info.n_layer, n_stages, weights, model=model)
    start, stop = plan[index]
    stage = Stage(StageSpec(
        model_path=stage_slice(m_path, start, stop, cache_dir()), n_layer=stop - start,
        first=index == 0, last=index == n_stages - 1, n_ctx=config.ctx_size, n_threads=threads[rank],
        n_seq_max=config.n_seq_max, n_ubatch=config.ubatch,
        flash_attn=config.flash_attn, kv_unified=config.kv_unified,
    ))
    draft_stage = None
    if rank == 0 and roles.has_draft and roles.n_draft == 0:
        try:
            draft_stage = Stage(StageSpec(model_path=draft_path, n_layer=draft_info.n_layer, first=True, last=True,
                                          n_ctx=config.ctx_size, n_threads=threads[0], n_seq_max=config.n_seq_max,
                                          n_ubatch=config.ubatch, flash_attn=config.flash_attn))
        except BaseException:
            stage.close()
            raise
    return _Loaded(stage, (start, stop), str(m_path), roles, draft_stage)


def check_same_vocab(target, draft) -> None:
    """Refuse a draft whose vocabulary differs from the target's: speculation
    compares token ids, so they must mean the same text.

    Raises:
        ConfigError: sizes, special tokens or token texts differ.
    """
    if target.n_vocab != draft.n_vocab:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.n_vocab} tokens, {draft.path.name}) differs from the target's "
            f"({target.n_vocab} tokens, {target.path.name}): speculation needs the same tokenizer")
    for what in ("bos_token_id", "eos_token_id", "vocab_digest"):
        a, b = getattr(target, what, None), getattr(draft, what, None)
        if a != b:
            raise ConfigError(
                f"the draft model's vocabulary differs from the target's ({what.replace('_', ' ')}: "
                f"{b} vs {a}): speculation needs the same tokenizer")
