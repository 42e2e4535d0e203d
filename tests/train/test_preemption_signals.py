"""PreemptionGuard with real signals sent to this process: abort mode (nothing to save yet: StopRequested at
once, naming the signal and the phase) and defer mode (the flag the training loop polls)."""
import os
import signal
import time

import pytest

from llds_jax.runtime import storage
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


def test_an_error_that_library_code_made_of_the_stop_still_ends_as_the_stop():
    """asyncio's socket transports catch the StopRequested raised in a send and fail the connection with it; the
    retriever's check then raises an error of its own. The guard ends with the stop (exit 0), not that error."""
    with pytest.raises(StopRequested, match="^stopped by SIGTERM during the retriever check") as raised:
        with PreemptionGuard("the retriever check"):
            try:
                deliver(signal.SIGTERM)
            except BaseException as e:  # what asyncio's transport does, then the backend's check
                raise RuntimeError("http backend cannot serve searches") from e
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_errors_in_defer_mode_and_without_a_signal_pass_through():
    with pytest.raises(RuntimeError, match="disk full"):
        with PreemptionGuard() as guard:
            guard.defer()
            deliver(signal.SIGTERM)  # recorded: the loop saves, and saving may fail for its own reason
            raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="bad config"):
        with PreemptionGuard():
            raise RuntimeError("bad config")


def test_a_stop_that_code_swallowed_in_abort_mode_is_raised_again_before_the_loop_starts():
    with PreemptionGuard() as guard:
        try:
            deliver(signal.SIGTERM)
        except StopRequested:  # e.g. a finalizer or a library's bare `except`
            pass
        with pytest.raises(StopRequested, match="during start-up"):
            guard.defer()


def test_a_stop_that_lands_in_a_gc_callback_is_raised_again_without_a_report(capsys):
    """A signal whose handler runs inside a garbage-collection callback (as JAX's `_xla_gc_callback`): Python cannot
    raise the StopRequested there and used to print "Exception ignored in ..." with its traceback; the guard drops
    that report and raises the stop again moments later, in the code that runs."""
    import gc

    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            deliver(signal.SIGTERM)  # the handler runs here, inside the callback

    gc.callbacks.append(callback)
    try:
        with PreemptionGuard() as guard:
            with pytest.raises(StopRequested, match="during start-up"):
                gc.collect()
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    time.sleep(0.001)
    finally:
        gc.callbacks.remove(callback)
    assert fired and guard.signal_name == "SIGTERM"
    assert "Exception ignored" not in capsys.readouterr().err


def test_asyncios_report_of_the_stop_in_its_transport_is_dropped_while_the_guard_is_active(caplog):
    """A stop during the retriever's start-up check can land in asyncio's socket transport, which logged "Fatal write
    error on socket transport" with the StopRequested's traceback before the check failed as the stop."""
    import logging

    def report():
        try:
            raise StopRequested("SIGTERM", "the retriever's start-up check")
        except StopRequested:
            logging.getLogger("asyncio").error("Fatal write error on socket transport", exc_info=True)
        logging.getLogger("asyncio").error("another error", exc_info=(ValueError, ValueError("x"), None))

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with PreemptionGuard():
            report()
        assert [r.getMessage() for r in caplog.records] == ["another error"]
        report()  # the guard is gone: reported as before
        assert [r.getMessage() for r in caplog.records][1:] == ["Fatal write error on socket transport", "another error"]
