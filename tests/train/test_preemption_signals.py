"""PreemptionGuard with real signals sent to this process."""
import os
import signal
import time

import pytest

from llds_jax.train.preemption import PreemptionGuard


def deliver(signum):
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary of the main thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_sets_the_flag_and_handlers_are_restored(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        assert not guard.requested and guard.should_stop() is False
        deliver(signum)
        assert guard.requested and guard.should_stop() is True
        assert guard.signal_name == signal.Signals(signum).name
        deliver(signal.SIGTERM)  # later signals keep the first name
        assert guard.signal_name == signal.Signals(signum).name
    assert {s: signal.getsignal(s) for s in before} == before


def test_second_sigint_aborts():
    with PreemptionGuard() as guard:
        deliver(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="second signal \\(SIGINT\\) after SIGTERM"):
            deliver(signal.SIGINT)
        assert guard.signal_name == "SIGTERM"
