"""``ggpipe calibrate``: measure, on every rank of a job, what the simulator
and ``plan --balance`` need (ggpipe.sim.profile), with the real llama.cpp
stages and the real transport.

Per rank (on its own host and thread count):

* ``layer_s``: a middle stage of ``k`` layers (hidden states in, hidden
  states out, as ``ggpipe.runtime.stage`` runs it) against batch size
  1..32, divided by k, at KV length ``kv_ref``;
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
full logit row) through ggpipe's Transport: latency is the smallest
message's one-way time, bandwidth the slope up to the largest.

Ranks that share a host measure one at a time (a token passed in rank
order), so they do not slow each other down; ``concurrent=True`` measures
all at once (what a job on shared cores sees).
"""

from __future__ import annotations

import socket
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ggpipe.sim.profile import BATCH_SIZES, HostProfile, LinkProfile, Profile

TAG_TURN, TAG_PING, TAG_RECORD, TAG_LOAD = 91, 92, 93, 94
LOAD_BUSY, LOAD_WAIT, LOAD_STOP, LOAD_DONE = 1, 2, 3, 4


def _timed(fn: Callable[[], None], reps: int, min_s: float = 0.25) -> float:
    """Mean seconds of one call: one warm-up call, then at least ``reps``
    calls and at least ``min_s`` seconds of them. The mean over a span of
    that length, not a median of a few calls, so that what slows a host
    periodically (a CPU quota's throttling, every 100 ms by default) counts
    as it does in a job."""
    fn()
    n, t0 = 0, time.perf_counter()
    while n < reps or time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def _decode_cost(stage, n: int, pos0: int, reps: int, tokens: bool, last_only: bool = False,
                 min_s: float = 0.25) -> float:
    """Seconds of one decode of ``n`` tokens at positions pos0.. of sequence
    0 (its cells removed after each call); a last stage returns a logit row
    per token, or only the last one (``last_only``)."""
    from ggpipe.runtime.stage import KV_SEQ_RM

    pos = np.arange(pos0, pos0 + n, dtype=np.int32)
    ones = np.ones(n, dtype=np.int32)
    seqs = np.zeros(n, dtype=np.int32)
    outs = np.eye(1, n, n - 1, dtype=np.int8)[0] if last_only else np.ones(n, dtype=np.int8)
    rng = np.random.default_rng(n)
    toks = rng.integers(0, 1000, n).astype(np.int32) if tokens else None
    embd = None if tokens else rng.standard_normal((n, stage.n_embd)).astype(np.float32)

    def once() -> None:
        stage.decode(pos=pos, n_seq_id=ones, seq_ids=seqs, outputs=outs, tokens=toks, embd=embd)
        stage.kv(KV_SEQ_RM, 0, -1, pos0, -1)
    return _timed(once, reps, min_s)


def _fill(stage, n_cells: int, tokens: bool) -> None:
    """Put ``n_cells`` cells of sequence 0 in the stage's KV cache (positions 0..n-1)."""
    from ggpipe.runtime.stage import KV_SEQ_RM

    stage.kv(KV_SEQ_RM, 0, -1, 0, -1)
    step = 64
    rng = np.random.default_rng(0)
    for p0 in range(0, n_cells, step):
        n = min(step, n_cells - p0)
        stage.decode(pos=np.arange(p0, p0 + n, dtype=np.int32), n_seq_id=np.ones(n, np.int32),
                     seq_ids=np.zeros(n, np.int32), outputs=np.zeros(n, np.int8) if not stage.spec.last else
                     np.eye(1, n, n - 1, dtype=np.int8)[0],
                     tokens=rng.integers(0, 1000, n).astype(np.int32) if tokens else None,
                     embd=None if tokens else rng.standard_normal((n, stage.n_embd)).astype(np.float32))


def _layer_ranges(n_layer: int, k_layers: int = 4) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(k, middle range, last range): the k layers a middle stage and a last
    stage of the calibration hold (the middle one skips layer 0, the first
    stage's, when the model has 3 layers or more)."""
    k = max(1, min(k_layers, n_layer - 2)) if n_layer >= 3 else 1
    return k, ((1, 1 + k) if n_layer >= 3 else (0, 1)), (n_layer - k, n_layer)


def _stage(model: str, layers: tuple[int, int], first: bool, last: bool, threads: int, n_ctx: int = 1024,
           n_ubatch: int = 64):
    """A llama.cpp stage of ``model``'s ``layers`` (its cached slice; the
    whole file for all of them), as ``ggpipe.runtime.stage`` runs it."""
    from ggpipe.models.derive import stage_slice
    from ggpipe.models.registry import resolve
    from ggpipe.runtime.stage import Stage, StageSpec

    path = Path(stage_slice(resolve(model), *layers))
    return Stage(StageSpec(path, layers[1] - layers[0], first=first, last=last, n_ctx=n_ctx, n_threads=threads,
                           n_seq_max=1, n_ubatch=n_ubatch))


def measure_host(model: str, draft: str | None, threads: int, k_layers: int = 4, reps: int = 5,
                 kv_ref: int = 64, kv_long: int = 512, batch_sizes=BATCH_SIZES,
                 say: Callable[[str], None] = lambda s: None) -> HostProfile:
    """Measure this process's host (see the module docstring).

    Raises:
        ModelError: a model cannot be read or sliced.
        ConfigError: a context cannot be created."""
    from ggpipe.models.sizes import model_sizes

    sizes = model_sizes(model)
    k, mid_range, last_range = _layer_ranges(sizes.n_layer, k_layers)
    ctx = {"threads": threads, "n_ctx": max(1024, kv_long + 2 * max(batch_sizes)),
           "n_ubatch": max(64, max(batch_sizes))}

    say(f"middle stage, {k} layers")
    with _stage(model, mid_range, mid_range[0] == 0, False, **ctx) as mid:
        tok = mid.spec.first
        _fill(mid, kv_ref, tok)
        mid_s = [_decode_cost(mid, n, kv_ref, reps, tok) for n in batch_sizes]
        _fill(mid, kv_long, tok)
        long_s = _decode_cost(mid, 8, kv_long, reps, tok)
    say(f"last stage, {k} layers + output head")
    with _stage(model, last_range, False, True, **ctx) as last:
        _fill(last, kv_ref, False)
        last_s = [_decode_cost(last, n, kv_ref, reps, False) for n in batch_sizes]
    i8 = list(batch_sizes).index(8) if 8 in batch_sizes else len(batch_sizes) - 1
    layer_s = [t / k for t in mid_s]
    head_s = [max(1e-7, b - a) for a, b in zip(mid_s, last_s)]
    kv_slope = max(0.0, (long_s - mid_s[i8]) / k / batch_sizes[i8] / (kv_long - kv_ref))
    draft_s = None
    if draft is not None:
        say("draft model")
        with _stage(draft, (0, model_sizes(draft).n_layer), True, True, **ctx) as d:
            _fill(d, kv_ref, True)
            draft_s = [_decode_cost(d, n, kv_ref, reps, True, last_only=True) for n in batch_sizes]
    import psutil

    return HostProfile(
        host=socket.gethostname(), threads=threads, batch_sizes=list(batch_sizes), layer_s=layer_s,
        layer_bytes=int(np.mean(sizes.layer_bytes[last_range[0]:last_range[1]])), head_s=head_s,
        head_bytes=sizes.head_bytes, kv_s_per_cell=kv_slope, kv_ref=kv_ref, draft_s=draft_s, draft_name=draft,
        mem_bytes=int(psutil.virtual_memory().total))


def measure_overhead(mode: str, n_tokens: int = 256) -> float:
    """The decoding loop's own seconds per target result on this host:
    the loop of ``mode`` (pipeinfer: with the n-gram proposer) over an
    in-memory pipeline whose results are ready at once, minus the time spent
    inside that pipeline (its toy model and KV bookkeeping)."""
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.decoding.settings import SpecSettings
    from ggpipe.sampling import Sampler, SamplingParams
    from ggpipe.sim.toy import FakePipeline, ToyLM

    spent = [0.0]

    class Timed(FakePipeline):
        pass

    for verb in ("submit", "seq_rm", "seq_cp", "ready", "poll", "wait", "cancel", "head_idle"):
        def timed(self, *a, _f=getattr(FakePipeline, verb), **kw):
            t0 = time.perf_counter()
            try:
                return _f(self, *a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
        setattr(Timed, verb, timed)

    pipe = Timed(ToyLM(64, seed=3, flip=0.3), latency=1)
    spec = SpecSettings(mode="pipeinfer", spec_type="ngram", p_accept=0.0)
    dec = build_decoder(mode, spec, pipe, None, n_ubatch=512, n_seq_max=64, is_eog=lambda t: False, timeout_s=10.0)
    prompt = np.arange(48, dtype=np.int32) % 64
    sampler = Sampler(SamplingParams(temperature=0.0))
    dec.generate(prompt, 16, sampler)  # warm-up
    pipe.clear()
    dec.reset()
    runs0 = pipe.n_runs
    spent[0] = 0.0
    t0 = time.perf_counter()
    dec.generate(prompt, n_tokens, sampler)
    wall = time.perf_counter() - t0
    return max(0.0, (wall - spent[0]) / max(1, pipe.n_runs - runs0))


def _middle_stage(model: str, threads: int):
    """The middle stage :func:`measure_host` times, KV filled to 64 cells."""
    from ggpipe.models.sizes import model_sizes

    _, mid, _ = _layer_ranges(model_sizes(model).n_layer)
    st = _stage(model, mid, mid[0] == 0, False, threads)
    _fill(st, 64, st.spec.first)
    return st


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
    with _middle_stage(model, threads) as st:
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
                        _decode_cost(st, 1, 64, 1, tok, min_s=0.0)
                else:
                    waiter.recv(lead, TAG_LOAD, np.int32, "the end of a contention phase")
                    continue
                transport.recv(lead, TAG_LOAD, np.int32, "the end of a contention phase")

        def timed() -> float:
            return statistics.mean(_decode_cost(st, n, 64, reps, tok) for n in (1, 8))

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


def ping(transport, peer: int, initiator: bool, nbytes: int, iters: int) -> float | None:
    """Median one-way seconds of ``iters`` ping-pongs of ``nbytes`` with
    ``peer``; None on the echoing side."""
    msg = np.zeros(nbytes, dtype=np.int8)
    out = []
    for i in range(iters + 3):
        if initiator:
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

    rec = measure_host(model, draft, threads, reps=reps, say=said)
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
                times = [ping(jobwait, b if rank == a else a, rank == a, n, iters) for n in sizes]
                if rank == a:
                    lat, bw = fit_link(sizes, times)
                    links.append(LinkProfile(a, b, lat, bw))
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
