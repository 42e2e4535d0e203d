"""A damaged newest checkpoint (a data file truncated after it was written) costs one warning line: the run falls
back to the previous step and says so, without the storage library's dumps (other damage: tests/train/
test_ckpt_checkpointer.py)."""
import os
import re

import pytest

from llds_jax.train.checkpoint import MAX_REASON_CHARS
from tests.e2e.runs import finish, read_metrics
from tests.reliability.scripted_retriever import ScriptedRetriever

TIMEOUT_S = 300


def truncate_largest_file(folder: str) -> None:
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.slow
def test_truncated_newest_checkpoint_is_one_warning_and_the_run_goes_on(searching_runs):
    name = "truncated"
    run_dir = searching_runs.run_dir(name)
    with ScriptedRetriever() as server:
        finish([searching_runs.start(server.config(), name, train__total_steps=2, train__checkpoint_every=1)],
               TIMEOUT_S)
        truncate_largest_file(os.path.join(run_dir, "checkpoints", "2", "params"))
        output = finish([searching_runs.start(server.config(), name, train__checkpoint_every=1)], TIMEOUT_S)[0]
    warnings = [line for line in output.splitlines() if line.startswith("W") and "checkpoint.py" in line]
    assert len(warnings) == 2, output[-6000:]
    assert re.search(r"checkpoint step 2 in \S+ is unreadable \(Exception: Encountered error while reading array "
                     r"index: .*\(caused by ValueError: OUT_OF_RANGE: .*\); falling back to the previous step$",
                     warnings[0]), warnings[0]
    assert re.search(r"moved unreadable checkpoint \S+/2 to \S+/2\.unreadable-\d+$", warnings[1]), warnings[1]
    assert "resumed from step 1" in output
    reason_text = warnings[0].split(" is unreadable (", 1)[1].rsplit("); falling back", 1)[0]
    assert len(reason_text) <= MAX_REASON_CHARS  # the error's first lines, not orbax's 60-line TensorStore spec
    assert "Event loop is closed" not in output and "Traceback" not in output and "Exception ignored" not in output
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
