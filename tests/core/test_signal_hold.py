"""``stop_signals_held``: a stop signal that comes while a child starts waits until the block ends
(``multinode.Cluster.start`` lists the child for the teardown inside it)."""
from __future__ import annotations

import os
import signal

import pytest

from hybrid_build.core.stop_signals import stop_signals_held


def test_a_stop_signal_waits_until_a_started_child_is_listed():
    """SIGINT/SIGTERM/SIGHUP are held back from the block (in ``Cluster.start``: the ``Popen`` and
    the listing of the child for the teardown); the signal then reaches the handler that was there
    (a child started in that window once outlived a SIGTERM)."""
    class Stop(Exception):
        pass

    def stop(signum, _frame):
        raise Stop(signum)

    before = signal.signal(signal.SIGTERM, stop)
    reached = []
    try:
        with pytest.raises(Stop):
            with stop_signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append("listed")
        assert reached == ["listed"] and signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, before)
