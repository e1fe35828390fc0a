"""PartitionPool (FIFO of KV sequence-id partitions) and CutoffController
(confidence cutoff of continuous speculation). MPI-free, fast."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggpipe.errors import ConfigError
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.partitions import PartitionPool

# ---- PartitionPool ------------------------------------------------------------


def test_partition_layout():
    pool = PartitionPool(n_seq_max=10, width=3)
    assert pool.n_partitions == 3 and pool.width == 3 and pool.n_free == 3
    assert [pool.seqs(i) for i in range(3)] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_partitions_never_use_sequence_0_and_fit():
    for n_seq_max in range(2, 40):
        for width in range(1, n_seq_max):
            pool = PartitionPool(n_seq_max, width)
            ids = [s for i in range(pool.n_partitions) for s in pool.seqs(i)]
            assert 0 not in ids and len(ids) == len(set(ids))
            assert max(ids) < n_seq_max
            assert pool.n_partitions == (n_seq_max - 1) // width


def test_fifo_order():
    pool = PartitionPool(n_seq_max=9, width=2)      # 4 partitions
    got = [pool.acquire() for _ in range(4)]
    assert got == [0, 1, 2, 3]
    assert pool.acquire() is None and pool.n_free == 0
    pool.release(2)
    pool.release(0)
    assert pool.n_free == 2
    assert pool.acquire() == 2                      # oldest released first
    pool.release(3)
    assert [pool.acquire(), pool.acquire(), pool.acquire()] == [0, 3, None]


def test_release_errors():
    pool = PartitionPool(n_seq_max=5, width=2)
    with pytest.raises(ValueError):
        pool.release(0)                             # never acquired
    i = pool.acquire()
    pool.release(i)
    with pytest.raises(ValueError):
        pool.release(i)                             # twice
    with pytest.raises(ValueError):
        pool.release(7)                             # no such partition
    assert pool.n_free == 2


@pytest.mark.parametrize("n_seq_max,width", [(1, 1), (2, 2), (4, 4), (8, 8), (1, 0), (5, 0), (5, -1)])
def test_too_small_is_config_error(n_seq_max, width):
    with pytest.raises(ConfigError):
        PartitionPool(n_seq_max, width)


def test_smallest_fit():
    assert PartitionPool(5, 4).n_partitions == 1
    assert PartitionPool(2, 1).seqs(0) == [1]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(2, 20), st.integers(1, 4))
def test_pool_matches_fifo_model(ops, n_seq_max, width):
    if (n_seq_max - 1) // width < 1:
        return
    pool = PartitionPool(n_seq_max, width)
    free = list(range(pool.n_partitions))
    used = []
    for acquire in ops:
        if acquire:
            got = pool.acquire()
            assert got == (free.pop(0) if free else None)
            if got is not None:
                used.append(got)
        elif used:
            i = used.pop(0)
            pool.release(i)
            free.append(i)
        assert pool.n_free == len(free)


# ---- CutoffController ------------------------------------------------------------


def test_cutoff_starts_at_p_accept():
    c = CutoffController(p_accept=0.4, p_recovery=0.1, p_decay=0.05)
    assert c.cutoff == pytest.approx(0.4) and not c.exhausted


def test_cutoff_rises_per_continued():
    c = CutoffController(p_accept=0.4, p_recovery=0.1, p_decay=0.05)
    for i in range(1, 6):
        c.continued()
        assert c.cutoff == pytest.approx(0.4 + 0.1 * i)
        assert not c.exhausted                      # up to 0.9
    c.continued()
    c.continued()
    assert c.exhausted and c.cutoff > 1.0


def test_cutoff_falls_per_failed_while_idle_not_below_floor():
    c = CutoffController(p_accept=0.5, p_recovery=0.1, p_decay=0.15, floor=0.1)
    c.failed_while_idle()
    assert c.cutoff == pytest.approx(0.35)
    c.failed_while_idle()
    assert c.cutoff == pytest.approx(0.2)
    for _ in range(10):
        c.failed_while_idle()
        assert c.cutoff == pytest.approx(0.1)        # clamped at the floor
    assert not c.exhausted


def test_default_floor_zero():
    c = CutoffController(p_accept=0.1, p_decay=0.5)
    c.failed_while_idle()
    assert c.cutoff == 0.0


def test_accepted_resets():
    c = CutoffController(p_accept=0.5, p_recovery=0.2, p_decay=0.1)
    for _ in range(3):
        c.continued()
    c.failed_while_idle()
    assert c.cutoff == pytest.approx(0.5 + 0.6 - 0.1) and c.exhausted
    c.accepted()
    assert c.cutoff == pytest.approx(0.5) and not c.exhausted
    c.failed_while_idle()
    c.accepted()
    assert c.cutoff == pytest.approx(0.5)


def test_rise_and_fall_combine():
    c = CutoffController(p_accept=0.5, p_recovery=0.05, p_decay=0.05)
    c.continued()
    c.continued()
    c.failed_while_idle()
    assert c.cutoff == pytest.approx(0.55)


def test_exhausted_at_exactly_one():
    c = CutoffController(p_accept=1.0)
    assert c.exhausted
    c = CutoffController(p_accept=0.75, p_recovery=0.25)
    c.continued()
    assert c.cutoff == 1.0 and c.exhausted


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("cfa"), max_size=40), st.floats(0, 1), st.floats(0, 0.5), st.floats(0, 0.5),
       st.floats(0, 0.5))
def test_cutoff_model(ops, p_accept, rec, dec, floor):
    c = CutoffController(p_accept=p_accept, p_recovery=rec, p_decay=dec, floor=floor)
    n_c = n_f = 0
    for op in ops:
        if op == "c":
            c.continued()
            n_c += 1
        elif op == "f":
            c.failed_while_idle()
            n_f += 1
        else:
            c.accepted()
            n_c = n_f = 0
        want = max(floor, p_accept + n_c * rec - n_f * dec)
        assert c.cutoff == pytest.approx(want)
        assert c.cutoff >= floor
        assert c.exhausted == (c.cutoff >= 1.0)


def test_cutoff_rise_resets_on_a_new_root():
    """Speculation that only ever fails must not lock the cutoff at 1."""
    c = CutoffController(p_accept=0.3, p_recovery=0.1, p_decay=0.05)
    for _ in range(8):
        c.continued()
    assert c.exhausted
    c.rerooted()
    assert abs(c.cutoff - 0.3) < 1e-12 and not c.exhausted


def test_wait_pays_weighs_the_next_token_against_the_wait():
    """wait_pays: (1 + E + P p) / (wait + c(n+1)) > (1 + E) / c(n)."""
    from ggpipe.speculation.adaptive import PassCost, wait_pays

    cost = PassCost()
    assert not wait_pays([0.9], 0.001, 1, cost)           # no cost curve yet: send now
    cost.observe(1, 0.050)
    cost.observe(2, 0.055)                                 # +5 ms per token
    # a confident chain and a next token due in 2 ms: (1 + .9 + .81) / 62 ms > 1.9 / 55 ms
    assert wait_pays([0.9], 0.002, 1, cost)
    # due in 40 ms: not worth it
    assert not wait_pays([0.9], 0.040, 1, cost)
    # an unlikely chain: the next token would hardly be accepted
    assert not wait_pays([0.2], 0.002, 1, cost)
    # monotone: a longer wait never turns "no" into "yes"
    answers = [wait_pays([0.9, 0.8], w / 1000, 2, cost) for w in range(0, 60)]
    assert answers == sorted(answers, reverse=True) and answers[0] and not answers[-1]
    # an overdue token (negative wait) counts as due now
    assert wait_pays([0.9], -0.01, 1, cost) == wait_pays([0.9], 0.0, 1, cost)
