"""The head's wait for "any result" while it drives several pipelines (the
target's and the draft models'): woken at once by its own stages' events,
and probing for the other ranks' results only around the time they are due.

The speculative loops (``ggpipe.decoding``) call a wait with their own
readiness predicate whenever neither the target nor the proposer has
anything to hand them. Two kinds of results end such a wait:

* **local**: the head's own stage of a pipeline (an executor thread) finished
  a run or ran out of work. The executor calls the pipeline's ``on_event``,
  which :class:`EventWait` points at one :class:`threading.Event`; the wait
  blocks on it, so a local result costs no polling and no latency.
* **remote**: a result from a pipeline's last stage on another rank. MPI has
  no wake-up a thread can block on without spinning a core (a blocking
  ``MPI_Probe`` busy-polls in MPICH and Open MPI), so the wait probes, but
  often only from shortly before the time the oldest in-flight run's result
  is due (:meth:`ggpipe.pipeline.driver.Pipeline.result_due`: when it started,
  or when the previous result arrived, plus the measured service time, per
  token for prompt chunks); until then it sleeps on the event, probing once
  per 2 ms (or 1% of a longer service time) in case the result comes
  earlier than estimated, and the probes back off to 0.2% of the service
  time once it is due: a stage computing beside the head keeps its core.

:func:`poll_wait` is the plain alternative (back-off polling, 20-200 us) for
pipelines without those hooks, e.g. in-memory fakes.

No MPI here; the pipelines probe.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from ggpipe.errors import RankTimeoutError

Ready = Callable[[], bool]
Wait = Callable[[Ready, float], None]  # wait(ready, timeout_s): returns when ready() may be true

__all__ = ["EventWait", "Ready", "Wait", "poll_wait"]


def _timeout(timeout_s: float) -> RankTimeoutError:
    return RankTimeoutError(f"the head waited {timeout_s:.0f} s for a target or draft result: "
                            "no rank answered (raise --timeout if they are only slow)")


def poll_wait(ready: Ready, timeout_s: float, min_s: float = 20e-6, max_s: float = 200e-6) -> None:
    """Return when ``ready()`` is true, probing it with sleeps that grow
    from ``min_s`` to ``max_s`` (seconds).

    Raises:
        RankTimeoutError: not ready after ``timeout_s`` seconds."""
    t0 = time.perf_counter()
    delay = min_s
    while not ready():
        if time.perf_counter() - t0 > timeout_s:
            raise _timeout(timeout_s)
        time.sleep(delay)
        delay = min(delay * 1.5, max_s)


class EventWait:
    """A wait over ``pipes`` (objects with ``on_event`` and ``result_due()``,
    i.e. :class:`ggpipe.pipeline.driver.Pipeline`), called as
    ``wait(ready, timeout_s)``.

    Args:
        pipes: the pipelines whose results the loop waits for; their
            ``on_event`` is set to this wait's wake-up.
        lead: probing starts this share of the expected service time before
            a remote result is due (0.25: 5 ms early for a 20 ms draft step),
            at most ``lead_max_s`` before it (a 1 s prompt chunk's result is
            probed for from 10 ms before it is due, not 250 ms).
        min_s, max_s: back-off range of the sleeps between probes once a
            remote result is due (seconds); for a long service, up to
            ``poll_share`` of it instead of ``max_s``.
        idle_s: longest sleep with nothing due (only a local event or the
            time-out can end such a wait; re-checked this often anyway).
        early_max_s: longest sleep before a remote result is due: one probe
            per this many seconds bounds the delay when a result comes far
            earlier than its estimate (2 ms), or per ``early_share`` of a
            longer service (a 1 s prompt chunk: 10 ms). Each probe costs the
            head's Python tens of microseconds (over 100 on a slow core):
            polling at the short-step rates through seconds-long prompt
            chunks took a tenth of a core from the stage computing beside
            it.
        early_share, poll_share: the longest sleep between probes before
            and after a result is due, as a share of its expected service
            time, where that is more than ``early_max_s`` or ``max_s``
            (0.01 and 0.002: a result found at most 1% of its service time
            late when it comes far earlier than due, 0.2% otherwise).

    Attributes:
        stats: "waits" (calls that had to wait), "probes" (readiness checks
            made while waiting), "local_wakeups" (waits ended by a local
            event).
    """

    def __init__(self, pipes: Sequence, lead: float = 0.25, min_s: float = 20e-6, max_s: float = 200e-6,
                 idle_s: float = 0.05, early_max_s: float = 2e-3, lead_max_s: float = 0.01,
                 early_share: float = 0.01, poll_share: float = 0.002):
        self.pipes = list(pipes)
        self.lead = lead
        self.early_share = early_share
        self.poll_share = poll_share
        self.lead_max_s = lead_max_s
        self.min_s = min_s
        self.max_s = max_s
        self.idle_s = idle_s
        self.early_max_s = early_max_s
        self._wake = threading.Event()
        for p in self.pipes:
            p.on_event = self._wake.set
        self.stats = {"waits": 0, "probes": 0, "local_wakeups": 0}

    def _due(self) -> tuple[float, float] | None:
        """(time, service time) of the earliest remote result expected, or None."""
        best = None
        for p in self.pipes:
            d = p.result_due()
            if d is not None and (best is None or d[0] < best[0]):
                best = d
        return best

    def __call__(self, ready: Ready, timeout_s: float) -> None:
        """Return when ``ready()`` is true (it is called after every wake-up
        and probe; it may change its mind only through the pipelines).

        Raises:
            RankTimeoutError: not ready after ``timeout_s`` seconds."""
        st = self.stats
        self._wake.clear()        # cleared before the check: an event after it is not lost
        if ready():
            return
        st["waits"] += 1
        t0 = time.perf_counter()
        delay = self.min_s
        while True:
            now = time.perf_counter()
            if now - t0 > timeout_s:
                raise _timeout(timeout_s)
            due = self._due()
            if due is None:
                sleep, polling = min(self.idle_s, timeout_s), False
            else:
                at, service = due
                early = at - min(self.lead * service, self.lead_max_s) - now
                polling = early <= self.min_s
                sleep = delay if polling else min(early, max(self.early_max_s, self.early_share * service))
            if self._wake.wait(sleep):
                st["local_wakeups"] += 1
                delay = self.min_s
            elif polling:
                delay = min(delay * 1.5, max(self.max_s, self.poll_share * service))
            self._wake.clear()
            st["probes"] += 1
            if ready():
                return
