"""HeartbeatMonitor: the MPI-free bookkeeping behind dead/stuck rank detection."""

from ggpipe.transport.liveness import HeartbeatMonitor, process_state


def test_silent_peer_is_overdue_after_the_timeout():
    m = HeartbeatMonitor([1, 2], timeout_s=5.0, now=100.0)
    assert m.overdue(104.9) == []
    m.heard(1, 104.0)
    late = m.overdue(105.5)
    assert [p for p, _ in late] == [2]
    assert abs(late[0][1] - 5.5) < 1e-9


def test_longest_silence_first_and_departed_peers_ignored():
    m = HeartbeatMonitor([1, 2, 3], timeout_s=1.0, now=0.0)
    m.heard(2, 3.0)
    m.heard(3, 1.0, leaving=True)  # shut down normally
    assert [p for p, _ in m.overdue(5.0)] == [1, 2]


def test_old_heartbeats_never_move_time_back_and_strangers_are_ignored():
    m = HeartbeatMonitor([1], timeout_s=1.0, now=0.0)
    m.heard(1, 5.0)
    m.heard(1, 2.0)
    m.heard(7, 9.0)
    assert m.last == {1: 5.0}


def test_process_state_of_this_and_a_missing_process():
    import os

    assert process_state(os.getpid()) == "running"
    assert process_state(2**22 + 12345) == "exited"
