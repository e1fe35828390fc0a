"""The head's wait for "any result" (ggpipe.pipeline.waiting): woken by local
events at once, probing remote results only around their due time, bounded
by its time-out. No MPI, no model: pipelines are stand-ins with the two hooks."""

from __future__ import annotations

import threading
import time

import pytest

from ggpipe.errors import RankTimeoutError
from ggpipe.pipeline.waiting import EventWait, poll_wait


class FakePipe:
    """on_event (set by the wait) and result_due() -> (time, service) or None."""

    def __init__(self, due=None):
        self.on_event = None
        self.due = due

    def result_due(self):
        return self.due


def test_a_local_event_ends_the_wait_at_once_without_polling():
    pipe = FakePipe()
    wait = EventWait([pipe], idle_s=1.0)   # only the event can end it early
    done = threading.Event()

    def finish():
        time.sleep(0.05)
        done.set()
        pipe.on_event()

    threading.Thread(target=finish).start()
    t0 = time.perf_counter()
    wait(done.is_set, timeout_s=5.0)
    dt = time.perf_counter() - t0
    assert 0.04 < dt < 0.5
    assert wait.stats["local_wakeups"] == 1 and wait.stats["probes"] <= 2


def test_an_event_between_the_check_and_the_sleep_is_not_lost():
    pipe = FakePipe()
    wait = EventWait([pipe], idle_s=1.0)   # a lost event would cost this whole second
    calls = []

    def ready():
        calls.append(1)
        if len(calls) == 1:
            pipe.on_event()   # lands right after the first check
            return False
        return True

    t0 = time.perf_counter()
    wait(ready, timeout_s=5.0)
    assert time.perf_counter() - t0 < 0.5  # not the 1 s idle sleep (wide: CI machines stall for tens of ms)


def test_a_remote_result_is_probed_only_from_shortly_before_it_is_due():
    service = 0.08
    pipe = FakePipe()
    wait = EventWait([pipe], lead=0.25, early_max_s=1.0, idle_s=1.0)
    t0 = time.perf_counter()
    pipe.due = (t0 + service, service)
    seen = []

    def ready():
        now = time.perf_counter()
        seen.append(now)
        return now >= t0 + service

    wait(ready, timeout_s=5.0)
    # the first probe after the initial check comes no earlier than lead * service before the due time
    assert seen[1] >= t0 + service * (1 - 0.25) - 2e-3
    assert time.perf_counter() - t0 < service + 0.5   # probed, not an idle second
    # back-off polling over 20 ms from 20 us to 200 us: tens of probes, not the ~400 of a 200 us poll for 80 ms
    assert wait.stats["probes"] < 150


def test_a_result_far_earlier_than_its_estimate_is_seen_within_the_probe_interval():
    pipe = FakePipe()
    wait = EventWait([pipe], early_max_s=2e-3, idle_s=1.0)
    t0 = time.perf_counter()
    pipe.due = (t0 + 2.0, 2.0)             # estimated in two seconds, arrives after 10 ms
    wait(lambda: time.perf_counter() - t0 > 0.01, timeout_s=5.0)
    assert time.perf_counter() - t0 < 0.5  # long before the estimate or an idle second (wide for CI stalls)
    assert wait.stats["probes"] <= 12       # one per 2 ms, not a poll


def test_an_overdue_result_is_polled_with_back_off():
    pipe = FakePipe(due=(time.perf_counter() - 1.0, 0.01))
    wait = EventWait([pipe])
    t0 = time.perf_counter()
    wait(lambda: time.perf_counter() - t0 > 0.02, timeout_s=5.0)
    assert 2 <= wait.stats["probes"] <= 400   # polled (a CI stall can swallow most of the 20 ms)


def test_a_long_service_is_probed_at_a_share_of_it_not_at_the_short_steps_rate():
    """A prompt chunk's result due in a second and a half: probed from 10 ms
    before it is due (not a quarter of the service), before that once per
    1% of the service, overdue with sleeps backing off to 0.2% of it: a
    few dozen probes where a 2 ms probe and a 200 us poll would make
    hundreds, and the stage computing beside the head keeps its core."""
    pipe = FakePipe()
    wait = EventWait([pipe], idle_s=1.0)
    t0 = time.perf_counter()
    service = 1.5
    pipe.due = (t0 + 0.3, service)     # estimated at 300 ms; comes at 340 ms, overdue by 40 ms
    seen = []

    def ready():
        seen.append(time.perf_counter())
        return seen[-1] - t0 > 0.34

    wait(ready, timeout_s=5.0)
    assert time.perf_counter() - t0 < 0.34 + 0.5        # found within the poll interval (wide for CI stalls)
    assert wait.stats["probes"] < 60                    # 300 ms / 15 ms + the back-off to 3 ms over 40 ms
    # no probe before the due time's lead of 10 ms, other than the 15 ms early ones
    early = [b - a for a, b in zip(seen, seen[1:]) if b - t0 < 0.29]
    assert all(gap > 0.01 for gap in early[1:])


@pytest.mark.parametrize("due", [None, "overdue"])
def test_the_wait_is_bounded_and_says_so(due):
    pipe = FakePipe(due=None if due is None else (time.perf_counter() - 1.0, 0.01))
    wait = EventWait([pipe], idle_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(RankTimeoutError, match="waited 0 s for a target or draft result"):
        wait(lambda: False, timeout_s=0.1)
    assert time.perf_counter() - t0 < 1.0


def test_poll_wait_returns_when_ready_and_is_bounded():
    t0 = time.perf_counter()
    poll_wait(lambda: time.perf_counter() - t0 > 0.01, timeout_s=5.0)
    with pytest.raises(RankTimeoutError):
        poll_wait(lambda: False, timeout_s=0.05)


def test_the_earliest_due_pipeline_decides():
    now = time.perf_counter()
    slow, soon = FakePipe(due=(now + 10.0, 1.0)), FakePipe(due=(now + 0.03, 0.03))
    wait = EventWait([slow, soon, FakePipe()])
    assert all(p.on_event is not None for p in wait.pipes)
    t0 = time.perf_counter()
    wait(lambda: time.perf_counter() - t0 > 0.03, timeout_s=5.0)
    assert time.perf_counter() - t0 < 0.5
