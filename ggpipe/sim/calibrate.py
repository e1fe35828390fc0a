"""``ggpipe calibrate``: measure, on every rank of a job, what the simulator
and ``plan --balance`` need (ggpipe.sim.profile), with the real llama.cpp
stages and the real transport.

Per rank (on its own host and thread count):

* ``layer_s``: a middle stage of ``k`` layers (hidden states in, hidden
  states out, as ``ggpipe.runtime.stage`` runs it) against batch size
  1..32, divided by k, at KV length ``kv_ref``; k is the layers of a stage
  of this job (the model's layers over its ranks), and at least enough that
  the stage's weights are twice the last-level cache (ggpipe.sim.measure.
  stream_layers), so every decode streams them from memory as a job's
  stage does (one block timed alone stays in the cache and runs faster:
  ``cached_layer_s`` records it, and calibrate prints both);
* ``head_s``: a last stage of the same k layers minus the middle stage:
  the output norm and LM head for one logit row per token;
* ``kv_s_per_cell``: the middle stage at batch 8 with ``kv_long`` cells
  in the cache against ``kv_ref``;
* ``draft_s`` (with a draft model): the whole draft against batch size,
  one logit row per decode (more rows add the head's cost per row);
* ``overhead_s`` / ``spec_overhead_s`` (rank 0): the iterative and the
  pipelined decoding loop's own time per result, over an in-memory pipeline
  whose results are ready at once (ggpipe.sim.toy), the time spent inside
  that pipeline taken out.

Per link between neighbours (ranks i, i+1 and the last back to 0): a
ping-pong of the sizes a job sends (a header, one and 32 hidden states, a
full logit row) through ggpipe's Transport: bandwidth is the slope from the
smallest message to the largest; latency the smallest message's one-way time
to a rank that has waited as long as a job's rank waits for its next run
(``IDLE_GAP_S``: its waits have backed off to their longest sleep, so a
message is noticed later than in a tight ping-pong).

Ranks that share a host measure one at a time (a token passed in rank
order), so they do not slow each other down; ``concurrent=True`` measures
all at once (what a job on shared cores sees).

A rank's own measurements (the stage costs and the loop overhead) are in
ggpipe.sim.measure; this module is the job around them: the measuring turns
of ranks that share a host, their contention, the links, and the profile.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Callable

import numpy as np

from ggpipe.sim.measure import decode_cost, measure_host, measure_overhead, middle_stage
from ggpipe.sim.profile import LinkProfile, Profile

TAG_TURN, TAG_PING, TAG_RECORD, TAG_LOAD = 91, 92, 93, 94
LOAD_BUSY, LOAD_WAIT, LOAD_STOP, LOAD_DONE = 1, 2, 3, 4


def measure_contention(transport, group: list[int], model: str, threads: int, reps: int,
                       say: Callable[[str], None]) -> tuple[list[float], list[float]] | None:
    """How much slower a rank computes while ``j`` other ranks of its host
    (``group``, rank order) compute (busy) or wait for a message (polling, as
    an idle rank of a job does), for j = 1 .. len(group) - 1: the time of a
    middle stage at batch 1 and 8 against the same alone, averaged. The
    group's first rank measures (returns (busy, wait) slowdowns); the others
    make the load when told to (return None)."""
    from ggpipe.transport.mpi import Transport

    me = transport.rank
    lead = group[0]
    # waiting load: poll like a job's rank between pipeline hops (never settling into idle sleeps)
    waiter = Transport(transport.comm, timeout_s=transport.timeout_s, idle_after_s=1e9)
    with middle_stage(model, threads) as st:
        tok = st.spec.first
        if me != lead:
            transport.send(lead, TAG_LOAD, np.array([LOAD_DONE], np.int32))  # ready
            while True:
                _, cmd = transport.recv(lead, TAG_LOAD, np.int32, "a contention command",
                                        timeout_s=transport.timeout_s * 10)
                if int(cmd[0]) == LOAD_STOP:
                    return None
                transport.send(lead, TAG_LOAD, np.array([LOAD_DONE], np.int32))  # the load has started
                if int(cmd[0]) == LOAD_BUSY:
                    while transport.probe(lead, TAG_LOAD) is None:
                        decode_cost(st, 1, 64, 1, tok, min_s=0.0)
                else:
                    waiter.recv(lead, TAG_LOAD, np.int32, "the end of a contention phase")
                    continue
                transport.recv(lead, TAG_LOAD, np.int32, "the end of a contention phase")

        def timed() -> float:
            return statistics.mean(decode_cost(st, n, 64, reps, tok) for n in (1, 8))

        def timed_under(kind: int, others: list[int]) -> float:
            for r in others:
                transport.send(r, TAG_LOAD, np.array([kind], np.int32))
            for r in others:
                transport.recv(r, TAG_LOAD, np.int32, "the start of a contention load")
            t = statistics.mean(timed() for _ in range(2))
            for r in others:
                transport.send(r, TAG_LOAD, np.array([0], np.int32))
            transport.flush()
            return t

        for r in group[1:]:
            transport.recv(r, TAG_LOAD, np.int32, "a rank's readiness for the contention phase",
                           timeout_s=transport.timeout_s * 10)
        busy, wait = [], []
        for j in range(1, len(group)):
            others = group[1:1 + j]
            say(f"contention: {j} other rank(s) of this host computing, then waiting")
            alone = timed()
            busy.append(timed_under(LOAD_BUSY, others) / alone)
            wait.append(timed_under(LOAD_WAIT, others) / alone)
        for r in group[1:]:
            transport.send(r, TAG_LOAD, np.array([LOAD_STOP], np.int32))
        transport.flush()
        return busy, wait


def fit_link(sizes: list[int], one_way: list[float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a link from one-way times of
    messages of ``sizes`` bytes (ascending): latency is the smallest
    message's time, bandwidth the slope between the smallest and the largest
    (0: no measurable slope, an unlimited link)."""
    dt = one_way[-1] - one_way[0]
    bw = (sizes[-1] - sizes[0]) / dt if dt > 0 else 0.0
    return max(0.0, float(one_way[0])), float(bw)


#: Seconds the initiator of an idle ping waits before each ping: about a stage's
#: compute time, long enough for the echoing rank's waits to back off fully.
IDLE_GAP_S = 0.003


def ping(transport, peer: int, initiator: bool, nbytes: int, iters: int, gap_s: float = 0.0) -> float | None:
    """Median one-way seconds of ``iters`` ping-pongs of ``nbytes`` with
    ``peer`` (the round trip halved); None on the echoing side. ``gap_s``:
    the initiator waits that long before each ping (the round trip then
    holds the echoing rank's late notice of the ping once)."""
    msg = np.zeros(nbytes, dtype=np.int8)
    out = []
    for i in range(iters + 3):
        if initiator:
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            transport.send(peer, TAG_PING, msg)
            transport.recv(peer, TAG_PING, np.int8, "the calibration pong")
            if i >= 3:
                out.append((time.perf_counter() - t0) / 2)
        else:
            _, buf = transport.recv(peer, TAG_PING, np.int8, "the calibration ping")
            transport.send(peer, TAG_PING, buf)
    transport.flush()
    return statistics.median(out) if initiator else None


def calibrate_job(transport, model: str, draft: str | None, threads: int, concurrent: bool = False,
                  reps: int = 5, iters: int = 20, say: Callable[[str], None] = lambda s: None) -> Profile | None:
    """Every rank of the job measures itself and its link to the next rank;
    rank 0 returns the profile, the others None.

    Raises:
        RankTimeoutError: a rank did not answer in time (names it)."""
    from ggpipe.models.sizes import model_sizes

    from ggpipe.transport.mpi import Transport

    rank, size = transport.rank, transport.size
    host = socket.gethostname()
    hosts = [host]
    if size > 1:
        if rank == 0:
            hosts += [transport.recv_obj(r, TAG_RECORD, "the host name") for r in range(1, size)]
            for r in range(1, size):
                transport.send_obj(r, TAG_RECORD, hosts)
        else:
            transport.send_obj(0, TAG_RECORD, host)
            hosts = transport.recv_obj(0, TAG_RECORD, "the host list")
    shared = [r for r in range(size) if hosts[r] == host]
    turns = not concurrent and len(shared) > 1
    before = [r for r in shared if r < rank]
    if turns and before:
        transport.recv_obj(before[-1], TAG_TURN, "the measuring turn", timeout_s=transport.timeout_s * 10)

    def said(s: str) -> None:
        say(f"rank {rank} ({host}): {s}")

    rec = measure_host(model, draft, threads, reps=reps, say=said, job_ranks=size)
    rec.rank = rank
    if rank == 0:
        said("decoding loop overhead")
        rec.overhead_s = measure_overhead("iterative")
        rec.spec_overhead_s = measure_overhead("pipeinfer")
    after = [r for r in shared if r > rank]
    if turns and after:
        transport.send_obj(after[0], TAG_TURN, "go")
    if len(shared) > 1:
        # every rank of the host has measured alone: then they measure how they slow each other down
        if rank == shared[0]:
            for r in shared[1:]:
                transport.recv_obj(r, TAG_TURN, "the end of the host's measurements",
                                   timeout_s=transport.timeout_s * 10)
            for r in shared[1:]:
                transport.send_obj(r, TAG_TURN, "contention")
        else:
            transport.send_obj(shared[0], TAG_TURN, "measured")
            transport.recv_obj(shared[0], TAG_TURN, "the contention phase", timeout_s=transport.timeout_s * 10)
        got = measure_contention(transport, shared, model, threads, reps, said)
        if rank == shared[0]:
            for r in shared[1:]:
                transport.send_obj(r, TAG_RECORD, got)
        else:
            got = transport.recv_obj(shared[0], TAG_RECORD, "the contention figures",
                                     timeout_s=transport.timeout_s * 10)
        rec.busy_slowdown, rec.wait_slowdown = list(got[0]), list(got[1])

    links: list[LinkProfile] = []
    if size > 1:
        ms = model_sizes(model)
        sizes = [64, 4 * ms.n_embd, 32 * 4 * ms.n_embd, 4 * ms.n_vocab]
        pairs = [(i, i + 1) for i in range(size - 1)] + ([(size - 1, 0)] if size > 2 else [])
        # every wait polls as a job's ranks do between hops (never settling into idle sleeps), so a
        # pair's messages see the wake-ups of the ranks sharing its cores
        jobwait = Transport(transport.comm, timeout_s=transport.timeout_s * 10, idle_after_s=1e9)
        for a, b in pairs:  # one pair at a time, in the same order on every rank
            if rank in (a, b):
                if rank == a:
                    said(f"link to rank {b}")
                peer = b if rank == a else a
                times = [ping(jobwait, peer, rank == a, n, iters) for n in sizes]
                idle = ping(transport, peer, rank == a, sizes[0], iters, gap_s=IDLE_GAP_S)
                if rank == a:
                    lat, bw = fit_link(sizes, times)
                    # the round trip to an idle rank: its late notice once, then a tight reply
                    links.append(LinkProfile(a, b, max(lat, 2 * idle - lat), bw))
            # everyone waits for the pair to finish: a token through rank 0
            if rank == 0:
                for r in range(1, size):
                    jobwait.recv_obj(r, TAG_TURN, "the end of a link measurement")
                for r in range(1, size):
                    jobwait.send_obj(r, TAG_TURN, "next")
            else:
                jobwait.send_obj(0, TAG_TURN, "done")
                jobwait.recv_obj(0, TAG_TURN, "the next link measurement")
        jobwait.flush()

    if rank != 0:
        transport.send_obj(0, TAG_RECORD, (rec, links))
        transport.flush()
        return None
    records, all_links = [rec], list(links)
    for r in range(1, size):
        rrec, rlinks = transport.recv_obj(r, TAG_RECORD, "the calibration record", timeout_s=transport.timeout_s * 10)
        records.append(rrec)
        all_links += rlinks
    meta = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ranks": size,
            "threads": threads, "concurrent": concurrent}
    return Profile(model, draft, records, all_links, meta)
