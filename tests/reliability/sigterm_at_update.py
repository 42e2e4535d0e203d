"""`python -m tests.reliability.sigterm_at_update STEP UPDATE LAUNCH_ARGS...` runs `llds_jax.launch LAUNCH_ARGS...`,
and the process sends itself SIGTERM once update UPDATE (1-based) of step STEP is done, just before the trainer's
stop check after it: a preemption notice landing among a step's updates, at the same update on any machine (a
signal sent from outside races updates that take milliseconds). The signal, its handler, the check and the save
are the product's own; only the moment is chosen."""
import itertools
import os
import signal
import sys
import time

from absl import app, flags

from llds_jax import launch
from llds_jax.train.trainer import Trainer


def signal_at(step: int, update: int) -> None:
    """Makes every Trainer send SIGTERM to this process before its stop check after `update` of `step`."""
    train_step, stop_check = Trainer.train_step, Trainer.stop_check
    current = {"step": 0}

    def counting_train_step(self, state, ref_params, step_now, guard=None):
        current["step"] = step_now
        return train_step(self, state, ref_params, step_now, guard)

    def signalling_stop_check(self, guard, phase):
        check = stop_check(self, guard, phase)
        if phase != "updates" or check is None:
            return check
        updates_done = itertools.count(1)

        def check_after_update():
            if next(updates_done) == update and current["step"] == step:
                print(f"SIGTERM sent at monotonic {time.monotonic():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
            check()

        return check_after_update

    Trainer.train_step, Trainer.stop_check = counting_train_step, signalling_stop_check


if __name__ == "__main__":
    signal_at(int(sys.argv[1]), int(sys.argv[2]))
    sys.argv[1:3] = []
    flags.mark_flag_as_required("config")
    app.run(launch.main, flags_parser=launch.parse_flags)
