"""`python -m tests.reliability.phase_marks [--sigterm-at-load] [--sigterm-in-warm-start] LAUNCH_ARGS...` runs
`llds_jax.launch LAUNCH_ARGS...`
and prints `EVALUATION <name> STARTS` (flushed) as each evaluation begins (`<name>`: `start` for train.eval_at_start,
`step_<N>` for the one after step N), so that a test's scripted retriever can tell an evaluation's searches from a
step's. With `--sigterm-at-load` the process sends itself SIGTERM as the model starts loading (a preemption notice
during start-up, at the same point on any machine). The signal, its handler and the stop are the product's own;
With `--sigterm-in-warm-start` a helper thread sends SIGTERM WARM_START_DELAY_S after the warm start draws its
WARM_START_BATCH-th batch: by then its loop has compiled its step and (before issue 58) queued every step up to
the next log line, and the main thread waits on them. Only the moment is chosen."""
import os
import signal
import sys
import threading
import time

from absl import app, flags

from llds_jax import launch
from llds_jax.model import hf_io
from llds_jax.train.trainer import Trainer

SIGTERM_AT_LOAD = "--sigterm-at-load"
SIGTERM_IN_WARM_START = "--sigterm-in-warm-start"
WARM_START_BATCH = 3
WARM_START_DELAY_S = 3.0


def mark_evaluations() -> None:
    evaluate = Trainer.evaluate

    def marked(self, params, examples, out_dir=None, *args, **kwargs):
        print(f"EVALUATION {out_dir.name if out_dir is not None else 'unnamed'} STARTS", flush=True)
        return evaluate(self, params, examples, out_dir, *args, **kwargs)

    Trainer.evaluate = marked


def sigterm_at_load() -> None:
    load_model = hf_io.load_model

    def signalling(*args, **kwargs):
        print(f"SIGTERM sent at monotonic {time.monotonic():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        return load_model(*args, **kwargs)

    hf_io.load_model = signalling


def send_sigterm() -> None:
    print(f"SIGTERM sent at monotonic {time.monotonic():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def sigterm_in_warm_start() -> None:
    from llds_jax.sft import stage

    draw = stage.Batches.__next__
    drawn = []

    def counting(self):
        drawn.append(1)
        if len(drawn) == WARM_START_BATCH:
            threading.Timer(WARM_START_DELAY_S, send_sigterm).start()
        return draw(self)

    stage.Batches.__next__ = counting


if __name__ == "__main__":
    mark_evaluations()
    if SIGTERM_AT_LOAD in sys.argv:
        sys.argv.remove(SIGTERM_AT_LOAD)
        sigterm_at_load()
    if SIGTERM_IN_WARM_START in sys.argv:
        sys.argv.remove(SIGTERM_IN_WARM_START)
        sigterm_in_warm_start()
    flags.mark_flag_as_required("config")
    app.run(launch.main, flags_parser=launch.parse_flags)
