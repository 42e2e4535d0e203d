"""`python -m tests.reliability.phase_marks [--sigterm-at-load] LAUNCH_ARGS...` runs `llds_jax.launch LAUNCH_ARGS...`
and prints `EVALUATION <name> STARTS` (flushed) as each evaluation begins (`<name>`: `start` for train.eval_at_start,
`step_<N>` for the one after step N), so that a test's scripted retriever can tell an evaluation's searches from a
step's. With `--sigterm-at-load` the process sends itself SIGTERM as the model starts loading (a preemption notice
during start-up, at the same point on any machine). The signal, its handler and the stop are the product's own;
only the moment is chosen."""
import os
import signal
import sys
import time

from absl import app, flags

from llds_jax import launch
from llds_jax.model import hf_io
from llds_jax.train.trainer import Trainer

SIGTERM_AT_LOAD = "--sigterm-at-load"


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


if __name__ == "__main__":
    mark_evaluations()
    if SIGTERM_AT_LOAD in sys.argv:
        sys.argv.remove(SIGTERM_AT_LOAD)
        sigterm_at_load()
    flags.mark_flag_as_required("config")
    app.run(launch.main, flags_parser=launch.parse_flags)
