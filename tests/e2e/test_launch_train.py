"""`python -m llds_jax.launch` end to end on CPU: the tiny config's generated world, embedded index and 1-layer
policy; TensorBoard events, checkpoints, SIGTERM + resume equal to an uninterrupted run, one-line errors."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.runs import comparable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny_test.py")


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, like a plain user run
    env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(run_dir, *overrides, wait=True):
    cmd = [sys.executable, "-m", "llds_jax.launch", f"--config={TINY}", f"--config.run_dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_train_writes_events_checkpoints_and_eval_table(tmp_path):
    run_dir = str(tmp_path / "run")
    code, out, err = launch(run_dir)
    assert code == 0, err[-3000:]
    assert "training stopped after step 2 of 2" in out
    assert "data_source" in out and "mean" in out  # the final EM table
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["1", "2"]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("reward/mean", "actor/grad_norm", "actor/entropy", "lld/rate", "lld/logp_mean_correct",
                "rollout/valid_searches", "perf/tokens_per_s", "eval/em_mean", "optim/learning_rate"):
        logged = [r[tag] for r in records if tag in r]
        assert logged, tag
        # TensorBoard holds exactly the defined values of the JSONL log (null: undefined, e.g. the LLD rate of a
        # step without a correct trajectory).
        defined = [v for v in logged if v is not None]
        assert (tag in tags) == bool(defined), tag
        if defined:
            assert [e.value for e in events.Scalars(tag)] == pytest.approx(defined, rel=1e-6), tag
    assert events.Tags()["tensors"]  # transcript text summaries
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["data"]["samples_per_prompt"] == 2


@pytest.mark.slow
def test_sigterm_saves_and_resume_equals_uninterrupted(tmp_path):
    args = ("--config.train.total_steps=4", "--config.train.eval_every=0", "--config.train.final_eval=False",
            "--config.train.checkpoint_every=100")
    straight = str(tmp_path / "straight")
    code, _, err = launch(straight, *args)
    assert code == 0, err[-3000:]

    stopped = str(tmp_path / "stopped")
    proc = launch(stopped, *args, "--config.train.checkpoint_every=1", wait=False)
    ckpt_dir = os.path.join(stopped, "checkpoints")
    deadline = time.time() + 300
    while not (os.path.isdir(ckpt_dir) and "1" in os.listdir(ckpt_dir)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    stopped_at = int(out.split("training stopped after step ")[1].split()[0])
    assert 1 <= stopped_at < 4 and str(stopped_at) in os.listdir(ckpt_dir)

    code, out, err = launch(stopped, *args)
    assert code == 0, err[-3000:]
    assert "resumed from step" in err
    resumed, reference = read_metrics(stopped), read_metrics(straight)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [comparable(r) for r in resumed] == [comparable(r) for r in reference]
    # The resume dropped --config.train.checkpoint_every=1: it says so and keeps the config it replaced.
    assert (f"llds_jax: resuming {stopped} from step {stopped_at} with 1 changed config key(s): "
            f"train.checkpoint_every: 1 -> 100 (the earlier config is kept as config.before-step-{stopped_at}.json;")\
        in err
    with open(os.path.join(stopped, f"config.before-step-{stopped_at}.json")) as f:
        assert json.load(f)["train"]["checkpoint_every"] == 1
    with open(os.path.join(stopped, "config.json")) as f:
        assert json.load(f)["train"]["checkpoint_every"] == 100
    # A total below the folder's last step trains nothing: one line, exit 2, the record untouched.
    code, out, err = launch(stopped, *args[1:], "--config.train.total_steps=2")
    assert (code, err.splitlines()[-1]) == (2, f"llds_jax: error: run folder {stopped} holds a checkpoint of step 4, "
                                               "past train.total_steps = 2: raise train.total_steps to train on, or "
                                               "start a new run with another --config.run_dir")
    with open(os.path.join(stopped, "config.json")) as f:
        assert json.load(f)["train"]["total_steps"] == 4


@pytest.mark.parametrize("override,message", [
    ("--config.optim.lamda=1", "llds_jax: error: unknown config key optim.lamda\n"),
    ("--config.optim.learning_rate=abc", "could not convert string to float: 'abc'"),
    ("--config.optim.mini_batch_size=3", "optim.mini_batch_size (3) must divide the rollout batch"),
])
def test_bad_config_is_one_line(tmp_path, override, message):
    code, out, err = launch(str(tmp_path / "run"), override)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


BUG_APP = '''
"""The demo application, plus a loss term with a bug: a shape error raised while the train step is traced."""
from llds_jax.apps.demo import check_config, config_sections, paths, provided_keys  # noqa: F401
from llds_jax.apps import demo
from llds_jax.rl.terms import register_loss_term


def prepare_run(cfg):
    values = demo.prepare_run(cfg)

    @register_loss_term("test_buggy_llds")
    def buggy(inputs, objective):
        raise ValueError("operands could not be broadcast together with shapes (2,3) (4,)")

    return {**values, "objective.llds.variant": "test_buggy_llds"}
'''


@pytest.mark.slow
def test_a_bug_inside_training_shows_its_traceback(tmp_path):
    """A ValueError of changed code is not bad input: launch lets it through with its traceback (exit 1), where
    bad input is one line (exit 2, the test above)."""
    (tmp_path / "buggy_app.py").write_text(BUG_APP)
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    cmd = [sys.executable, "-m", "llds_jax.launch", f"--config={TINY}", f"--config.run_dir={tmp_path / 'run'}",
           "--config.app=buggy_app"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert 'in buggy\n    raise ValueError("operands could not be broadcast' in proc.stderr
    assert "llds_jax: error:" not in proc.stderr
