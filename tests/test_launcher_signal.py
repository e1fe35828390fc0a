"""The launcher's SIGUSR1 outside the heartbeat watch (MPI-free): remembered
during start-up, ignored once the watch has stopped."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ggpipe.errors import RankLostError
from ggpipe.transport import launcher_signal as ls


@pytest.fixture(autouse=True)
def _restore_sigusr1():
    old = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, old)


def _deliver():
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary


def test_start_up_signal_is_remembered_and_reported():
    ls.watch_launcher_signal()
    ls.check_launcher_signal()  # nothing yet
    _deliver()
    with pytest.raises(RankLostError, match="ended during start-up"):
        ls.check_launcher_signal()
    ls.watch_launcher_signal()  # a new watch starts clean
    ls.check_launcher_signal()


def test_ignored_after_the_watch():
    ls.ignore_launcher_signal()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    _deliver()  # would end the process with the default action
