"""What one rank of ``ggpipe calibrate`` measures of its host on its own
(ggpipe.sim.calibrate puts the job together): the costs of llama.cpp stages
of the model (a middle stage's layers against batch size, the output head,
the KV cache's length, the draft model) and the decoding loop's own time per
result; see ggpipe.sim.calibrate's docstring for what each figure is."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ggpipe.sim.profile import BATCH_SIZES, HostProfile


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


def decode_cost(stage, n: int, pos0: int, reps: int, tokens: bool, last_only: bool = False,
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


#: Weight bytes the timed middle stage streams at least, where the last-level
#: cache's size is unknown (larger than any CPU's cache).
STREAM_BYTES_UNKNOWN_CACHE = 256 << 20


def last_level_cache_bytes(cpu: int = 0) -> int | None:
    """The size of the largest CPU cache of ``cpu`` (bytes), from Linux's
    ``/sys/devices/system/cpu/cpuN/cache/index*/size``; None where unknown."""
    best = None
    for d in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            best = max(best or 0, int(digits) * mult)
    return best


def stream_layers(layer_bytes: int, n_layer: int, llc_bytes: int | None, k_min: int = 4) -> int:
    """Blocks the calibration's middle stage holds: at least ``k_min``, and
    enough that their weights are twice the last-level cache (or
    :data:`STREAM_BYTES_UNKNOWN_CACHE`), so that every token streams them
    from memory as a job's stage does; at most the model's blocks but the
    first and the last (a model of 3 blocks or fewer: 1)."""
    if n_layer < 3:
        return 1
    need = 2 * llc_bytes if llc_bytes else STREAM_BYTES_UNKNOWN_CACHE
    k = max(k_min, -(-need // max(1, layer_bytes)))
    return max(1, min(k, n_layer - 2))


def _layer_ranges(n_layer: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(middle range, last range): the k layers of the calibration's middle
    stage (skipping layer 0, the first stage's, when the model has 3 layers
    or more) and of its last stage, before the output head."""
    return ((1, 1 + k) if n_layer >= 3 else (0, 1)), (n_layer - k, n_layer)


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


def measure_host(model: str, draft: str | None, threads: int, k_layers: int | None = None, reps: int = 5,
                 kv_ref: int = 64, kv_long: int = 512, batch_sizes=BATCH_SIZES,
                 say: Callable[[str], None] = lambda s: None, job_ranks: int = 1) -> HostProfile:
    """Measure this process's host (see the module docstring).

    The blocks' costs come from a middle stage of ``k_layers`` blocks run in
    sequence (None: as many as a stage of a job of ``job_ranks`` ranks holds,
    and at least :func:`stream_layers`: weights of twice the last-level
    cache, as a job's stage streams them every token; a block costs more in
    a long stage than in a short one that already streams); one block timed alone
    again and again (its weights cached) is recorded beside them as the check
    (``cached_layer_s``). The head's cost is a last stage of as many blocks
    and the output head, less the middle stage: after that many blocks its
    weights come from memory too, as in a job (after one block, part of a
    small model's head would still be cached).

    Raises:
        ModelError: a model cannot be read or sliced.
        ConfigError: a context cannot be created."""
    from ggpipe.models.sizes import model_sizes

    sizes = model_sizes(model)
    mean_layer = int(np.mean(sizes.layer_bytes)) if len(sizes.layer_bytes) else 0
    k = k_layers or max(stream_layers(mean_layer, sizes.n_layer, last_level_cache_bytes()),
                        min(sizes.n_layer - 2, -(-sizes.n_layer // max(1, job_ranks))))
    mid_range, last_range = _layer_ranges(sizes.n_layer, k)
    k = mid_range[1] - mid_range[0]
    ctx = {"threads": threads, "n_ctx": max(1024, kv_long + 2 * max(batch_sizes)),
           "n_ubatch": max(64, max(batch_sizes))}

    say(f"middle stage, {k} layers ({k * mean_layer / 2**20:.0f} MiB of weights, streamed)")
    with _stage(model, mid_range, mid_range[0] == 0, False, **ctx) as mid:
        tok = mid.spec.first
        _fill(mid, kv_ref, tok)
        mid_s = [decode_cost(mid, n, kv_ref, reps, tok) for n in batch_sizes]
        _fill(mid, kv_long, tok)
        long_s = decode_cost(mid, 8, kv_long, reps, tok)
    layer_s = [t / k for t in mid_s]
    cached = None
    if k > 1:
        say("one block, cached (the check)")
        one = (mid_range[0], mid_range[0] + 1)
        with _stage(model, one, one[0] == 0, False, **ctx) as st:
            _fill(st, kv_ref, st.spec.first)
            cached = decode_cost(st, batch_sizes[0], kv_ref, reps, st.spec.first)
    say(f"last stage, {k} layers + output head")
    with _stage(model, last_range, last_range[0] == 0, True, **ctx) as last:
        _fill(last, kv_ref, last.spec.first)
        last_s = [decode_cost(last, n, kv_ref, reps, last.spec.first) for n in batch_sizes]
    i8 = list(batch_sizes).index(8) if 8 in batch_sizes else len(batch_sizes) - 1
    head_s = [max(1e-7, b - a) for a, b in zip(mid_s, last_s)]
    kv_slope = max(0.0, (long_s - mid_s[i8]) / k / batch_sizes[i8] / (kv_long - kv_ref))
    draft_s = None
    if draft is not None:
        say("draft model")
        with _stage(draft, (0, model_sizes(draft).n_layer), True, True, **ctx) as d:
            _fill(d, kv_ref, True)
            draft_s = [decode_cost(d, n, kv_ref, reps, True, last_only=True) for n in batch_sizes]
    import psutil

    return HostProfile(
        host=socket.gethostname(), threads=threads, batch_sizes=list(batch_sizes), layer_s=layer_s,
        layer_bytes=int(np.mean(sizes.layer_bytes[mid_range[0]:mid_range[1]])), head_s=head_s,
        head_bytes=sizes.head_bytes, kv_s_per_cell=kv_slope, kv_ref=kv_ref, draft_s=draft_s, draft_name=draft,
        mem_bytes=int(psutil.virtual_memory().total), stream_layers=k, cached_layer_s=cached)


def measure_overhead(mode: str, n_tokens: int = 256) -> float:
    """The decoding loop's own seconds per target result on this host:
    the loop of ``mode`` (pipeinfer: with the n-gram proposer) over an
    in-memory pipeline whose results are ready at once, minus the time spent
    inside that pipeline (its toy model and KV bookkeeping)."""
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.decoding.plan import DecodingPlan
    from ggpipe.decoding.settings import SpecSettings
    from ggpipe.sampling import Sampler
    from ggpipe.sampling_params import SamplingParams
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
    plan = DecodingPlan.resolve(mode, SpecSettings(spec_type="ngram", p_accept=0.0))
    dec = build_decoder(plan, pipe, None, n_ubatch=512, n_seq_max=64, is_eog=lambda t: False, timeout_s=10.0)
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


def middle_stage(model: str, threads: int, k: int = 4):
    """A middle stage of ``k`` blocks (the contention measurement's), KV
    filled to 64 cells."""
    from ggpipe.models.sizes import model_sizes

    n_layer = model_sizes(model).n_layer
    mid, _ = _layer_ranges(n_layer, min(k, max(1, n_layer - 2)))
    st = _stage(model, mid, mid[0] == 0, False, threads)
    _fill(st, 64, st.spec.first)
    return st
