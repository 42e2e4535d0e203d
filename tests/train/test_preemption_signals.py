"""PreemptionGuard with real signals sent to this process: abort mode (nothing to save yet: StopRequested at
once, naming the signal and the phase) and defer mode (the flag the training loop polls)."""
import os
import signal
import time

import pytest

from llds_jax import storage
from llds_jax.train.preemption import PreemptionGuard, StopRequested


def deliver(signum):
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary of the main thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_sets_the_flag_and_handlers_are_restored(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        guard.defer()
        assert not guard.requested and guard.should_stop() is False
        deliver(signum)
        assert guard.requested and guard.should_stop() is True
        assert guard.signal_name == signal.Signals(signum).name
        deliver(signal.SIGTERM)  # later signals keep the first name
        assert guard.signal_name == signal.Signals(signum).name
    assert {s: signal.getsignal(s) for s in before} == before


def test_second_sigint_aborts():
    with PreemptionGuard() as guard:
        guard.defer()
        deliver(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="second signal \\(SIGINT\\) after SIGTERM"):
            deliver(signal.SIGINT)
        assert guard.signal_name == "SIGTERM"


def test_a_signal_in_abort_mode_raises_stop_requested_naming_the_phase():
    with PreemptionGuard() as guard:
        with pytest.raises(StopRequested, match="^stopped by SIGTERM during start-up: nothing to save; the same "
                                                "command starts again$"):
            deliver(signal.SIGTERM)
        assert guard.requested
        with pytest.raises(StopRequested, match="during the warm start"):  # a signal that came already
            guard.abort_during("the warm start")
        assert storage._MONITOR.stop_at is not None  # storage operations get STOP_GRACE_S from the signal on
    assert storage._MONITOR.stop_at is None  # until the guard is gone
