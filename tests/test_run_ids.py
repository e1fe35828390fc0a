"""Run ids across their wrap-around: ids travel in int32
message fields and wrap after 2^31 runs; every rank compares them as serial
numbers (ggpipe.runs.run_id_after), so cancellations and prune messages of
runs issued after the wrap are still honoured by the workers and the
head's own stage."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from ggpipe import runs
from ggpipe.pipeline.masking import PruneBook
from ggpipe.pipeline.worker import Worker
from ggpipe.transport import messages as m

TOP = 2**31 - 1   # the largest run id an int32 field holds


@pytest.fixture
def restore_ids():
    yield
    runs.set_next_run_id(1)


def test_ids_wrap_inside_int32_and_keep_their_order(restore_ids):
    runs.set_next_run_id(TOP - 2)
    ids = [runs.next_run_id() for _ in range(6)]
    assert all(0 <= i <= TOP for i in ids)
    assert len(set(ids)) == 6
    for a, b in itertools.pairwise(ids):
        assert runs.run_id_after(b, a) and not runs.run_id_after(a, b)
    # every id fits the int32 fields of the messages and comes back unchanged
    for i in ids:
        assert m.decode_simple(m.encode_simple(m.T_CANCEL, i), m.T_CANCEL) == i
    assert runs.run_id_after(3, TOP - 5) and not runs.run_id_after(TOP - 5, 3)
    assert runs.latest_run_id(2, TOP) == 2 and runs.latest_run_id(TOP, 2) == 2
    assert runs.run_id_after(0, None) and not runs.run_id_after(7, 7)


def test_prune_book_across_the_wrap():
    book = PruneBook()
    # run TOP-1 was evaluated here; runs 2 and TOP are not yet (2 was issued after the wrap)
    book.add([(TOP - 1, 1), (TOP, 2), (2, 3)], done_below=TOP - 1)
    assert len(book) == 2
    book.forget_through(TOP)
    assert len(book) == 1 and book.take(2) == {3}


def _worker(last_run):
    hooks = SimpleNamespace(cancelled=0)
    hooks.cancel = lambda: setattr(hooks, "cancelled", hooks.cancelled + 1)
    stage = SimpleNamespace(hooks=hooks, spec=SimpleNamespace(n_seq_max=4), n_vocab=10)
    w = Worker(stage, transport=None, prev=0, next=None, head=0, max_tokens=8, cancel_src=0)
    w.last_run = last_run
    return w


def test_worker_keeps_cancels_and_prunes_of_runs_after_the_wrap():
    w = _worker(TOP - 1)             # the last run done here was issued just before the wrap
    w._register_cancel(m.encode_simple(m.T_CANCEL, 3))
    assert 3 in w.cancelled, "a cancel of a run issued after the wrap was dropped"
    w._register_cancel(m.encode_simple(m.T_CANCEL, TOP - 3))   # done here already: ignored
    assert TOP - 3 not in w.cancelled
    w._register_prune(m.encode_prune([(4, 2), (TOP - 2, 1)]))
    assert len(w.pruned) == 1 and w.pruned.take(4) == {2}


def test_worker_forgets_only_runs_done_across_the_wrap():
    """What a decoded run leaves behind (``_decode``'s bookkeeping, through
    ``_finish_cancelled``): the latest run done moves past the wrap, the
    cancels of later runs stay."""
    w = _worker(TOP - 1)
    w._register_cancel(m.encode_simple(m.T_CANCEL, 1))
    w._register_cancel(m.encode_simple(m.T_CANCEL, 0))
    sent = []
    w.t = SimpleNamespace(send=lambda *a: sent.append(a))
    h = m.DecodeHeader(TOP, np.zeros(1, np.int32), np.ones(1, np.int32), np.ones(1, np.int32),
                       np.ones(1, np.int8), m.PAYLOAD_NONE)
    w._finish_cancelled(h)
    assert w.last_run == TOP
    h.run_id = 0
    w._finish_cancelled(h)
    assert w.last_run == 0 and w.cancelled == {1}


@pytest.mark.mpi
@pytest.mark.full
def test_two_ranks_across_the_wrap_stay_exact_and_cancel(goliath, reference):
    """A real 2-rank pipeinfer job whose run ids wrap at its third run
    (``GGPIPE_FIRST_RUN_ID``): the tokens equal single-node llama.cpp's, and
    rank 1 (the target's second stage) honours the cancellations of runs
    issued after the wrap: runs the head cancelled come back cancelled from
    it (before the fix, every cancel after the wrap was dropped). Not every
    one: a cancel that reaches rank 1 after it finished the run finds nothing
    to stop, and that run comes back complete (``DecodeBackend.cancel``)."""
    from conftest import assert_greedy, PROMPTS, run_ggpipe

    prompt, n = PROMPTS[1], 64
    p = run_ggpipe(["generate", "-m", str(goliath), "-p", prompt, "-n", str(n), "--json", "--mode", "pipeinfer",
                    "--spec-type", "ngram"], 2, env={"GGPIPE_FIRST_RUN_ID": str(TOP - 2)})
    assert p.returncode == 0, p.stderr[-3000:]
    import json

    got = json.loads(p.stdout)
    assert_greedy(got["tokens"], goliath, prompt, n)
    dec = got["decoder"]
    assert dec["target_runs"] > 10           # the ids wrapped during the job
    assert dec["cancel_sent"] > 0, dec
    worker = next(r for r in got["ranks"] if r["rank"] == 1)
    assert worker["cancelled_before_start"] + worker["cancelled_mid_compute"] > 0, worker
    assert 0 < dec["returned_cancelled"] <= dec["cancel_sent"], dec
