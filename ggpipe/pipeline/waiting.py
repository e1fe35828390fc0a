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
  or when the previous result arrived, plus the measured service time);
  until then it sleeps on the event, probing once per 2 ms in case the
  result comes earlier than estimated.

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
            a remote result is due (0.25: 5 ms early for a 20 ms draft step).
        min_s, max_s: back-off range of the sleeps between probes once a
            remote result is due (seconds).
        idle_s: longest sleep with nothing due (only a local event or the
            time-out can end such a wait; re-checked this often anyway).
        early_max_s: longest sleep before a remote result is due: one probe
            per this many seconds bounds the delay when a result comes far
            earlier than its estimate (2 ms: about 1% of a core).

    Attributes:
        stats: "waits" (calls that had to wait), "probes" (readiness checks
            made while waiting), "local_wakeups" (waits ended by a local
            event).
    """

    def __init__(self, pipes: Sequence, lead: float = 0.25, min_s: float = 20e-6, max_s: float = 200e-6,
                 idle_s: float = 0.05, early_max_s: float = 2e-3):
        self.pipes = list(pipes)
        self.lead = lead
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
                early = at - self.lead * service - now
                polling = early <= self.min_s
                sleep = delay if polling else min(early, self.early_max_s)
            if self._wake.wait(sleep):
                st["local_wakeups"] += 1
                delay = self.min_s
            elif polling:
                delay = min(delay * 1.5, self.max_s)
            self._wake.clear()
            st["probes"] += 1
            if ready():
                return
