"""`python -m tests.reliability.sigterm_in_fit STEP LAUNCH_ARGS...` runs `llds_jax.launch LAUNCH_ARGS...`, prints
`STEP <n> STARTS` (flushed) as each training step begins and `FIT <chars>` as each prompt is fitted
(`protocol.fit_prompt`; its question's characters), and sends itself SIGTERM as the first prompt of step STEP is
being fitted: a preemption notice while a session's sequences are admitted, at the same point on any machine (before
issue 66 the barrier policy fitted every prompt of the session, a 1 MB question for seconds each time, before its
first stop check). The fit, the signal, its handler and the stop are the product's own; only the moment is chosen."""
import os
import signal
import sys
import time

from absl import app, flags

from llds_jax import launch, protocol
from llds_jax.train.trainer import Trainer


def signal_in_fit(step: int) -> None:
    """Marks every step and fit; SIGTERM to this process as the first fit of `step` begins."""
    train_step, fit_prompt = Trainer.train_step, protocol.fit_prompt
    current = {"step": 0, "sent": False}

    def marked_train_step(self, state, ref_params, step_now, guard=None):
        current["step"] = step_now
        print(f"STEP {step_now} STARTS", flush=True)
        return train_step(self, state, ref_params, step_now, guard)

    def signalling_fit_prompt(tokenizer, question, *args, **kwargs):
        print(f"FIT {len(question)}", flush=True)
        if current["step"] == step and not current["sent"]:
            current["sent"] = True
            print(f"SIGTERM sent at monotonic {time.monotonic():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        return fit_prompt(tokenizer, question, *args, **kwargs)

    Trainer.train_step, protocol.fit_prompt = marked_train_step, signalling_fit_prompt


if __name__ == "__main__":
    signal_in_fit(int(sys.argv[1]))
    sys.argv[1:2] = []
    flags.mark_flag_as_required("config")
    app.run(launch.main, flags_parser=launch.parse_flags)
