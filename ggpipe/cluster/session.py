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

The exchanges (steps 1, 2, 4, 5, and the HELLO that carries an error from a
rank that fails before step 1) are in ggpipe.cluster.startup, the loading
(step 3) in ggpipe.cluster.loading, the shared settings in
ggpipe.cluster.config; this module puts them together (:func:`open_session`)
and holds the running job's :class:`Session`.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from dataclasses import dataclass, field
from typing import Callable

from ggpipe.cluster.config import ClusterConfig, parse_threads
from ggpipe.cluster.loading import Loaded, close_loaded, describe_role, load_rank
from ggpipe.cluster.plan import concurrent_stages
from ggpipe.cluster.resources import POLL_OVERSUBSCRIBED_S, host_is_oversubscribed
from ggpipe.cluster.roles import Roles
from ggpipe.cluster.split import PROMPTS, parse_split, prompts_dominate
from ggpipe.cluster.startup import meet, ready
from ggpipe.errors import ConfigError, GGPipeError
from ggpipe.metrics import MemorySampler, rank_info
from ggpipe.pipeline.driver import Pipeline
from ggpipe.runtime.stage import Stage
from ggpipe.transport import messages as m
from ggpipe.transport import rank_guard
from ggpipe.transport.mpi import Transport, mpi_world


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
    cpus: list = field(default_factory=list)  # each rank's CPU affinity (CPU ids, or None)
    load_s: float = 0.0                     # seconds this rank's load took, of which warming up its stages:
    warmup_s: float = 0.0
    described: dict[int, str] = field(default_factory=dict)  # head: rank -> its model and layers

    def micro_batches_in_flight(self) -> int:
        """The scheduler's default micro-batches in flight (``--micro-batches
        auto``): the target stages that can compute at the same time, at
        most as many per host as its CPUs hold their threads
        (:func:`ggpipe.cluster.plan.concurrent_stages`)."""
        ranks = list(range(self.roles.n_target))      # the head holds the first stage
        return concurrent_stages(self.target_hosts, [self.cpus[r] if r < len(self.cpus) else None
                                                     for r in ranks],
                                 [parse_threads(self.config.threads, self.size)[r] for r in ranks])

    @property
    def target_hosts(self) -> list[str]:
        """The host of each target stage, in stage order (ranks 0..n_target-1)."""
        return [self.hosts[r] for r in range(self.roles.n_target)]

    @property
    def is_head(self) -> bool:
        """This rank is the head (rank 0)."""
        return self.rank == 0

    def rank_stats(self) -> dict:
        """This rank's statistics: its identity (:func:`ggpipe.metrics.rank_info`),
        model, layer range, threads, memory readings (bytes,
        :meth:`ggpipe.metrics.MemorySampler.report`), and the seconds its
        load took (``load_s``), of which warming its stages up
        (``warmup_s``)."""
        info = rank_info(self.rank)
        info.update(model=self.roles.model_of(self.rank), layers=list(self.layers),
                    threads=self.stage.spec.n_threads, load_s=round(self.load_s, 3),
                    warmup_s=round(self.warmup_s, 3), **self.memory.report())
        return info

    def serve(self, mid_run_cancels: bool = True) -> None:
        """Worker ranks: serve the pipeline until the head shuts it down, then
        send this rank's statistics to the head. ``mid_run_cancels``: the
        head may cancel runs (ggpipe.pipeline.worker.Worker)."""
        from ggpipe.pipeline.worker import Worker  # noqa: PLC0415

        w = Worker(self.stage, self.transport, max_tokens=self.config.n_batch, mid_run_cancels=mid_run_cancels,
                   **self.roles.links(self.rank))
        if self.activity is not None:
            self.activity.set(f"serving {describe_role(self.roles, self.rank, self.layers)}")
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
        """Release this rank's resources: stop the heartbeats, the memory
        sampler, and free the llama.cpp stages (the target's and, on a head
        holding it, the draft's)."""
        if self.liveness is not None:  # leaving; the peers' last heartbeats received before MPI_Finalize
            self.liveness.close()
        self.memory.stop()
        self.stage.close()
        if self.draft_stage is not None:
            self.draft_stage.close()


def open_session(config: ClusterConfig, argv: list[str] | None = None, async_head: bool = False,
                 workload: Callable[[], tuple[int, int] | None] | None = None) -> Session:
    """Bring up this rank (see the module docstring). ``argv`` (default
    ``sys.argv[1:]``) must be the same on every rank: its digest, with the
    config's, is compared at start-up. ``async_head``: run the head's target
    stage on an executor thread (speculation modes). ``workload``: called on
    the head alone, before the ranks meet, where no ``--split`` is given:
    the job's (prompt tokens, most generated tokens), or None where unknown;
    where prompts dominate (:func:`~ggpipe.cluster.split.prompts_dominate`)
    every rank splits for prompts (``--split prompts``), and the head says so.

    Raises:
        GGPipeError: on the head, the first error of any rank (naming it).
        RankFailedError: on a worker, when the job stops because of an error
            the head reports.
    """
    world = mpi_world()
    described: dict[int, str] = {}  # rank -> its model and layers, once loaded
    split_note = None   # the head's line on a split it chose for the workload
    if world is None:
        rank, size, transport, hosts, cpus = 0, 1, None, [socket.gethostname()], [rank_info(0)["cpu_affinity"]]
    else:
        if world[1] == 0:
            split_note = _prompts_split_note(config, workload, world[2])
        rank, size, transport, hosts, pids, cpus, agreed = meet(world, config, argv,
                                                                {"split": PROMPTS} if split_note else None)
        if agreed.get("split") is not None:
            config = dataclasses.replace(config, split=agreed["split"])
        _poll_for_host(transport, config, rank, size, hosts, cpus)

    activity = Activity("loading the model")
    liveness = None
    if transport is not None:
        liveness = _start_liveness(transport, config, rank, size, hosts, pids, activity, described)
        transport.interrupt = None

    memory = MemorySampler().start()
    # the head's target stage computes on its own thread when async_head: it warms up there (below)
    loaded = _load_when_all_can(config, rank, size, transport, liveness, described,
                                warm_target=not (rank == 0 and async_head))
    activity.set("idle")
    if split_note:
        sys.stderr.write(f"{split_note} ({'; '.join(described[r] for r in sorted(described))}); --split chooses "
                         f"another\n")
    s = Session(config, rank, size, transport, loaded.stage, loaded.layers, loaded.path, hosts,
                memory, loaded.roles, draft_stage=loaded.draft_stage, liveness=liveness, activity=activity,
                cpus=cpus, load_s=loaded.load_s, warmup_s=loaded.warmup_s, described=described)
    if rank == 0:
        _add_pipelines(s, loaded, async_head)
        if async_head:
            try:
                warm = s.pipeline.warm_up()
            except GGPipeError:
                try:    # every rank has loaded and waits for the head: stop them, then report the error
                    s.shutdown()
                finally:
                    s.close()
                raise
            s.warmup_s += warm
            s.load_s += warm
    return s


def _prompts_split_note(config: ClusterConfig, workload: Callable[[], tuple[int, int] | None] | None,
                        size: int) -> str | None:
    """On the head of a job of ``size`` ranks: where no ``--split`` is
    given, the target has several stages and ``workload()`` is mostly
    prompts, the start of the line that says the layers are split for them
    (completed with every rank's layers once they are loaded); else None."""
    if config.split is not None or workload is None or size < 2:
        return None
    try:
        roles = Roles.plan(size, parse_split(None), bool(config.draft_models),
                           n_draft_models=len(config.draft_models))
    except GGPipeError:
        return None  # loading reports it, on every rank
    if roles.n_target < 2:
        return None  # one target stage: nothing to split
    counts = workload()
    if counts is None or not prompts_dominate(*counts):
        return None
    n_prompt, n_generated = counts
    return (f"ggpipe: note: prompts are {n_prompt / (n_prompt + n_generated):.0%} of this job's tokens, so the layers "
            f"are split for them as --split {PROMPTS} splits them")


def _poll_for_host(transport: Transport, config: ClusterConfig, rank: int, size: int, hosts: list[str],
                   cpus: list) -> None:
    """Waits on a host whose CPUs the ranks' threads oversubscribe sleep up to
    ``POLL_OVERSUBSCRIBED_S`` between probes (ggpipe.transport.mpi)."""
    try:
        threads = parse_threads(config.threads, size)
    except ConfigError:
        return  # loading reports it, on every rank at once
    if host_is_oversubscribed(hosts, rank, threads, cpus):
        transport.poll_max_s = POLL_OVERSUBSCRIBED_S


def _load_when_all_can(config: ClusterConfig, rank: int, size: int, transport: Transport | None, liveness,
                       described: dict[int, str], warm_target: bool = True) -> Loaded:
    """Steps 3 to 5: load this rank's stage and learn whether every rank
    did; on an error anywhere, free what was loaded and raise it
    (``warm_target``: as :func:`~ggpipe.cluster.loading.load_rank`)."""
    err, loaded = None, None
    try:
        loaded = load_rank(config, rank, size, warm_target)
    except GGPipeError as exc:
        err = str(exc)
    role = None if loaded is None else describe_role(loaded.roles, rank, loaded.layers)
    if role is not None:
        rank_guard.set_role(f"{role}, {loaded.stage.weights} weights")
    if transport is not None:
        stop = ready(transport, rank, size, err, role, config.load_timeout_s, described)
        if stop is not None:
            liveness.close()
            close_loaded(loaded)
            raise stop
    elif err:
        raise GGPipeError(err)
    return loaded


def _add_pipelines(s: Session, loaded: Loaded, async_head: bool) -> None:
    """Head: the target pipeline and one per draft model."""
    config, roles = s.config, loaded.roles
    s.pipeline = Pipeline(loaded.stage, s.transport, roles.target_ranks, loaded.stage.n_vocab,
                          config.n_seq_max, max_outputs=config.n_batch, async_local=async_head, name="target")
    for k in range(len(roles.drafts)):
        s.draft_pipelines.append(Pipeline(loaded.draft_stage, s.transport, roles.draft_ranks_of(k),
                                          loaded.stage.n_vocab, config.draft_context[1], max_outputs=config.n_batch,
                                          name=roles.draft_name(k)))


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
