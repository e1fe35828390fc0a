"""Generation timing, memory sampling and rank identity (PipeInfer section V.A).

Timing definitions (:class:`GenerationClock`), following PipeInfer V.A:

* the token sampled from the prompt's logits ("prompt token") is *not* a
  generated token: PipeInfer excludes it because speculation is not engaged
  during prompt processing and a cached prompt has no such step;
* generation speed = generated tokens / (last acceptance - end of prompt
  processing), "not accounting for initial prompt processing and prefilling";
* TTFT = first acceptance after the prompt token - end of prompt processing;
* ITL = time between token acceptances (not between run start and end).

PipeInfer measures TTFT and ITL as CPU time of the main thread; ggpipe uses
wall time (``time.perf_counter``) by default, which also counts time blocked in
MPI waits. Pass ``now=time.thread_time`` (and call the clock from the main
thread only) to reproduce the paper's CPU-time figures.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import sys
import threading
import time
from collections import deque
from typing import Callable, Sequence

import numpy as np
import psutil

__all__ = ["GenerationClock", "MemorySampler", "TokenRate", "rank_info", "summarize_itl"]


def summarize_itl(gaps: Sequence[float]) -> dict:
    """``{"mean", "p50", "p90"}`` of ``gaps`` (seconds), numpy linear-interpolated
    percentiles; all None for an empty sequence."""
    a = np.asarray(gaps, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "p50": None, "p90": None}
    p50, p90 = np.percentile(a, [50, 90])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90)}


class TokenRate:
    """Tokens generated per second over the last ``window_s`` seconds, every
    request together (``/metrics``' aggregate tokens/s). :meth:`add` on the
    loop's thread keeps the window bounded whether or not anyone reads
    :meth:`per_s`, which any thread may call."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._recent: deque[tuple[float, int]] = deque()   # (when, tokens), monotonic seconds

    def add(self, n: int) -> None:
        """Count ``n`` tokens generated now; forget those older than the window."""
        now = time.monotonic()
        self._recent.append((now, n))
        while self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    def per_s(self) -> float:
        """Tokens per second over the window (tokens / ``window_s``)."""
        since = time.monotonic() - self.window_s
        return sum(n for t, n in list(self._recent) if t >= since) / self.window_s   # a copy: the loop appends

    def __len__(self) -> int:
        """Entries held (at most one per :meth:`add` within the window)."""
        return len(self._recent)


class GenerationClock:
    """Timestamps of one generation, on the head rank.

    Call order: construction (= start; or :meth:`start` to restart), then
    :meth:`prompt_done` when prompt processing ends, then :meth:`token` each time
    tokens are accepted, then :meth:`finish`.

    Prompt token: with ``count_prompt_token=True`` (default) the first
    ``token()`` call after ``prompt_done()`` is the token sampled from the
    prompt's logits; it must have ``n=1``, counts in :attr:`n_tokens` and
    :attr:`ttft_wall_s` but not in generation speed, TTFT or ITL. With
    ``count_prompt_token=False`` (the caller never reports it, e.g. a cached
    prompt) every ``token()`` call is a generation acceptance.

    All durations are seconds (float) from ``now`` (default
    ``time.perf_counter``); a figure that cannot be computed yet is None.
    ``token`` after ``finish``, ``token`` before ``prompt_done`` or a second
    ``prompt_done`` raise RuntimeError (caller bugs, not user errors).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter,
                 count_prompt_token: bool = True):
        self._now = now
        self._count_prompt_token = count_prompt_token
        self.start()

    def start(self) -> None:
        """(Re)start: forget everything and record the start time."""
        self.t_start: float = self._now()
        self.t_prompt_done: float | None = None
        self.t_prompt_token: float | None = None
        self.t_finish: float | None = None
        self._accept_t: list[float] = []  # generation acceptances (not the prompt token)
        self._accept_n: list[int] = []

    def prompt_done(self) -> None:
        """Record the end of prompt processing now.

        Raises:
            RuntimeError: called twice."""
        if self.t_prompt_done is not None:
            raise RuntimeError("GenerationClock.prompt_done() called twice")
        self.t_prompt_done = self._now()

    def token(self, n: int = 1) -> None:
        """Record that ``n`` >= 1 tokens were accepted now (n > 1: several
        speculated tokens accepted at once)."""
        if n < 1:
            raise ValueError(f"token(n): n must be >= 1, got {n}")
        if self.t_prompt_done is None:
            raise RuntimeError("GenerationClock.token() before prompt_done()")
        if self.t_finish is not None:
            raise RuntimeError("GenerationClock.token() after finish()")
        t = self._now()
        if self._count_prompt_token and self.t_prompt_token is None:
            if n != 1:
                raise ValueError("the first token() after prompt_done() is the token "
                                 f"sampled from the prompt's logits: n must be 1, got {n}")
            self.t_prompt_token = t
            return
        self._accept_t.append(t)
        self._accept_n.append(n)

    def finish(self) -> None:
        """Record the end of the generation now (a later call changes nothing)."""
        if self.t_finish is None:
            self.t_finish = self._now()

    # ---- counts ---------------------------------------------------------
    @property
    def n_gen_tokens(self) -> int:
        """Generated tokens: all accepted tokens except the prompt token."""
        return sum(self._accept_n)

    @property
    def n_tokens(self) -> int:
        """All tokens produced, the prompt token included (what the user sees)."""
        return self.n_gen_tokens + (self.t_prompt_token is not None)

    @property
    def n_acceptances(self) -> int:
        """Number of generation acceptance events (``token()`` calls, prompt
        token excluded); ``n_gen_tokens / n_acceptances`` is tokens per accept."""
        return len(self._accept_n)

    # ---- durations ------------------------------------------------------
    @property
    def prompt_s(self) -> float | None:
        """Prompt processing time: start -> prompt_done()."""
        return None if self.t_prompt_done is None else self.t_prompt_done - self.t_start

    @property
    def ttft_s(self) -> float | None:
        """PipeInfer V.A TTFT: prompt_done() -> first generation acceptance (the
        prompt token not counted)."""
        if not self._accept_t:
            return None
        return self._accept_t[0] - self.t_prompt_done

    @property
    def ttft_wall_s(self) -> float | None:
        """User-facing time to first token: start -> first token() call (the
        prompt token when it is counted)."""
        first = self.t_prompt_token
        if first is None and self._accept_t:
            first = self._accept_t[0]
        return None if first is None else first - self.t_start

    @property
    def gen_s(self) -> float | None:
        """Generation time: prompt_done() -> last generation acceptance."""
        if not self._accept_t:
            return None
        return self._accept_t[-1] - self.t_prompt_done

    @property
    def total_s(self) -> float | None:
        """start -> finish()."""
        return None if self.t_finish is None else self.t_finish - self.t_start

    @property
    def tokens_per_s(self) -> float | None:
        """PipeInfer V.A generation speed: n_gen_tokens / gen_s."""
        g = self.gen_s
        return None if not g else self.n_gen_tokens / g

    # ---- inter-token latency ------------------------------------------
    @property
    def acceptance_gaps_s(self) -> list[float]:
        """One gap per generation acceptance: time since the previous acceptance;
        the first gap is measured from prompt_done() (so it equals ttft_s and
        the gaps sum to gen_s)."""
        ts = [self.t_prompt_done] + self._accept_t if self._accept_t else []
        return [b - a for a, b in zip(ts[:-1], ts[1:])]

    @property
    def itl_s(self) -> list[float]:
        """One gap per generated token: an acceptance of n tokens contributes
        its gap divided by n, n times. Mean = gen_s / n_gen_tokens."""
        out: list[float] = []
        for gap, n in zip(self.acceptance_gaps_s, self._accept_n):
            out.extend([gap / n] * n)
        return out

    @property
    def itl_mean_s(self) -> float | None:
        """Mean per-token inter-token latency (= 1 / tokens_per_s)."""
        n = self.n_gen_tokens
        return None if n == 0 else self.gen_s / n

    def as_dict(self) -> dict:
        """All figures, JSON-serialisable: seconds, tokens/s, counts. ``itl_p50_s``
        / ``itl_p90_s`` / ``itl_accept_mean_s`` are over per-acceptance gaps;
        ``itl_mean_s`` is per token."""
        acc = summarize_itl(self.acceptance_gaps_s)
        return {
            "n_tokens": self.n_tokens,
            "n_gen_tokens": self.n_gen_tokens,
            "n_acceptances": self.n_acceptances,
            "prompt_s": self.prompt_s,
            "ttft_s": self.ttft_s,
            "ttft_wall_s": self.ttft_wall_s,
            "gen_s": self.gen_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
            "itl_mean_s": self.itl_mean_s,
            "itl_accept_mean_s": acc["mean"],
            "itl_p50_s": acc["p50"],
            "itl_p90_s": acc["p90"],
        }


def _ru_maxrss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024  # Linux reports KiB


#: errno values of "no file descriptor left" (the process's, the system's).
_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)


class MemorySampler:
    """Samples this process's memory on a daemon thread and keeps the peaks:
    RSS every ``interval_s`` seconds, PSS every ``pss_interval_s`` seconds and
    at every :meth:`sample` / :meth:`report` call.

    RSS from ``memory_info().rss`` (/proc/self/statm: microseconds); PSS from
    ``memory_full_info().pss`` (Linux: /proc/self/smaps_rollup), which charges
    shared pages (e.g. an mmapped model file shared by ranks on one host)
    proportionally; only faulted-in pages count, as with PipeInfer's pmap
    figures. A PSS reading walks every mapped page: 10-20 ms for a rank
    holding the 681 MB F32 target, so reading it every 0.2 s took 3-8% of a
    core from the rank's computation (measured with scripts/thread_cpu.py); a rank's PSS
    grows with its KV cache and is read again at :meth:`report`, so the
    slower rate loses little. Where PSS is
    unavailable the PSS figures are None. Peak RSS is floored by
    ``getrusage(RUSAGE_SELF).ru_maxrss`` (the kernel's high-water mark since
    process start, not since ``start()``; it catches spikes between samples).

    Use ``start()`` / ``stop()`` or ``with MemorySampler() as m: ...`` (then
    ``m.result``). :meth:`sample` takes one reading on demand.
    """

    def __init__(self, interval_s: float = 0.2, pss_interval_s: float = 10.0):
        if interval_s <= 0 or pss_interval_s <= 0:
            raise ValueError("interval_s and pss_interval_s must be > 0")
        self.interval_s = interval_s
        self.pss_interval_s = pss_interval_s
        self._pss_at = 0.0  # time.monotonic() of the last PSS reading
        self._proc = psutil.Process()
        self._has_pss = True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rss_bytes = self.peak_rss_bytes = 0
        self.pss_bytes: int | None = None
        self.peak_pss_bytes: int | None = None
        self.result: dict | None = None

    def _read(self, pss: bool = True) -> tuple[int, int | None]:
        if pss:
            self._pss_at = time.monotonic()
        if pss and self._has_pss:
            try:
                info = self._proc.memory_full_info()
                value = getattr(info, "pss", None)
                if value is not None:
                    return int(info.rss), int(value)
            except (psutil.AccessDenied, NotImplementedError, OSError) as e:
                if isinstance(e, OSError) and e.errno in _NO_DESCRIPTOR:
                    raise           # for now: the process's files are all open (a connection flood)
            self._has_pss = False
        return int(self._proc.memory_info().rss), None

    def sample(self, pss: bool = True) -> tuple[int, int | None]:
        """Take one reading now, update the peaks; returns (rss, pss) bytes
        (pss None when not read: ``pss=False``, or unavailable). With no file
        descriptor left to read ``/proc`` with (a connection flood), the
        reading is skipped: the last rss, pss None."""
        try:
            rss, pss = self._read(pss)
        except OSError as e:
            if e.errno not in _NO_DESCRIPTOR:
                raise
            return self.rss_bytes, None
        with self._lock:
            self.rss_bytes = rss
            if pss is not None or not self._has_pss:
                self.pss_bytes = pss
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            if pss is not None:
                self.peak_pss_bytes = max(self.peak_pss_bytes or 0, pss)
        return rss, pss

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample(pss=time.monotonic() - self._pss_at >= self.pss_interval_s)

    def start(self) -> "MemorySampler":
        """Take a first reading and start the sampling thread; returns ``self``.

        Raises:
            RuntimeError: already started."""
        if self._thread is not None:
            raise RuntimeError("MemorySampler already started")
        self.sample()
        self._thread = threading.Thread(target=self._run, name="ggpipe-mem", daemon=True)
        self._thread.start()
        return self

    def report(self) -> dict:
        """Take a reading now (the thread keeps running) and return
        ``{peak_rss_bytes, peak_pss_bytes, rss_bytes, pss_bytes}`` (ints; PSS
        entries None where unavailable)."""
        self.sample()
        with self._lock:
            self.peak_rss_bytes = max(self.peak_rss_bytes, _ru_maxrss_bytes())
            self.result = {
                "peak_rss_bytes": self.peak_rss_bytes,
                "peak_pss_bytes": self.peak_pss_bytes,
                "rss_bytes": self.rss_bytes,
                "pss_bytes": self.pss_bytes,
            }
        return self.result

    def stop(self) -> dict:
        """Stop the thread; returns :meth:`report`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return self.report()

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def rank_info(rank: int) -> dict:
    """Identity of this process: ``{rank, host, pid, cpu_affinity, cpu_count,
    cpu_count_physical}``. ``cpu_affinity`` is the sorted list of allowed CPU ids,
    or None where psutil cannot report it (e.g. macOS); counts may be None."""
    try:
        affinity = sorted(psutil.Process().cpu_affinity())
    except (AttributeError, NotImplementedError, psutil.Error, OSError):
        affinity = None
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpu_affinity": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
    }
