"""The transport's progress helper (ggpipe.transport.progress): one thread
reused by every block (a thread per block leaked MPICH's per-thread state,
see ggpipe/transport/progress.py), no step after stop(), a step's error handed back."""

from __future__ import annotations

import threading
import time

from ggpipe.transport.progress import PollingHelper


def test_one_thread_serves_every_block_and_no_step_runs_after_stop():
    h = PollingHelper("t-progress")
    before = threading.active_count()
    for _ in range(200):
        calls: list[int] = []
        h.start(lambda calls=calls: calls.append(1) or True, 1e-5, 1e-4)
        time.sleep(0.0005)
        assert h.stop() is None
        n = len(calls)
        time.sleep(0.002)
        assert len(calls) == n          # stopped: no further step
    assert h.threads_started == 1
    assert threading.active_count() <= before + 1


def test_a_block_with_nothing_left_idles_until_the_next():
    h = PollingHelper("t-progress")
    calls = []
    h.start(lambda: calls.append(1) and False, 1e-5, 1e-4)   # nothing more to do after the first step
    time.sleep(0.01)
    assert h.stop() is None and len(calls) == 1
    h.start(lambda: calls.append(2) and False, 1e-5, 1e-4)
    time.sleep(0.01)
    h.stop()
    assert calls == [1, 2]


def test_a_step_that_raises_ends_its_block_and_is_returned_once():
    h = PollingHelper("t-progress")

    def bad():
        raise RuntimeError("probe failed")

    h.start(bad, 1e-5, 1e-4)
    time.sleep(0.01)
    err = h.stop()
    assert isinstance(err, RuntimeError) and "probe failed" in str(err)
    h.start(lambda: True, 1e-5, 1e-4)   # the thread lives on
    time.sleep(0.002)
    assert h.stop() is None


def test_blocks_in_two_threads_at_once_each_get_a_helper():
    """Transport.computing keeps a free list: two threads computing at once
    (the async head's stage and the draft on the head) take one helper each."""
    from ggpipe.transport.mpi import Transport

    t = Transport.__new__(Transport)        # no communicator: only the helpers' bookkeeping is exercised
    t._lock, t._helpers, t._pending, t._link = threading.Lock(), [], [], None
    t.poll_min_s, t.poll_compute_s = 1e-5, 1e-4
    t.progress = lambda: 0
    blocks, seen = 2, []
    barrier = threading.Barrier(blocks)

    def block(i):
        with t.computing(on_poll=lambda: seen.append(i)):
            barrier.wait()
            time.sleep(0.003)

    threads = [threading.Thread(target=block, args=(i,)) for i in range(blocks)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert set(seen) == set(range(blocks)) and len(t._helpers) == blocks
    with t.computing(on_poll=lambda: None):
        pass
    assert len(t._helpers) == blocks    # reused, none added
