"""The warm start (`--mode=sft`) as a preempted or crashed machine leaves it, with the real command on a tiny world
(a 1-layer policy over a 512-token world vocabulary): SIGTERM in the middle of its steps ends it within
STOP_WITHIN_S (issue 58 item 6: its loop queued up to `sft.log_every` steps and waited on them, 176 s once), and a
`warm_start.json` cut by a kill or a full disk (empty, torn) is named in a warning and the warm start trained again
(item 5: "Expecting value: line 1 column 1 (char 0)" on every rerun, naming no file)."""
import os
import re

import pytest

from llds_jax.runtime.output_folder import MARKER
from tests.configs import CONFIGS
from tests.e2e.runs import start
from tests.reliability.test_stops import TIMEOUT_S, assert_stopped_in_time

TINY_WORLD = ("--config.demo.tokenizer=world", "--config.demo.vocab_size=512", "--config.demo.num_people=12",
              "--config.sft.enabled=True", "--config.sft.batch_size=8", "--config.sft.warmup_steps=1")


@pytest.fixture(scope="module")
def warm_start_runs(tmp_path_factory):
    """`launch(name, *args, launcher=...)`: the warm start of configs/tiny_test.py on the tiny world, whose assets
    all launches share (built by the first), in the run folder <root>/<name>; returns tests.e2e.runs.Launched."""
    root = tmp_path_factory.mktemp("warm_start_runs")

    def launch(name: str, *args: str, launcher=("-m", "llds_jax.launch")):
        return start(os.path.join(CONFIGS, "tiny_test.py"), 1, str(root / f"{name}.log"), "--mode=sft",
                     f"--config.run_dir={root / name}", f"--config.demo.assets_dir={root / 'assets'}", *TINY_WORLD,
                     *args, launcher=launcher, env={"JAX_COMPILATION_CACHE_DIR": str(root / "jax_cache")})

    launch.root = root
    return launch


@pytest.mark.slow
def test_sigterm_during_the_warm_start_exits_0_within_the_bound(warm_start_runs):
    """The signal comes 3 s after the 3rd batch is drawn (tests/reliability/phase_marks.py): the old loop had
    queued all 400 steps by then (one log line at the end) and waited on them."""
    launched = warm_start_runs("stop", "--sigterm-in-warm-start", "--config.sft.steps=400",
                               "--config.sft.log_every=400", launcher=("-m", "tests.reliability.phase_marks"))
    launched.process.wait(TIMEOUT_S)
    signalled = re.search(r"SIGTERM sent at monotonic (\S+)", launched.output())
    assert signalled, launched.output()[-4000:]
    output = assert_stopped_in_time(launched, float(signalled.group(1)))
    assert ("llds_jax: stopped by SIGTERM during the warm start: nothing to save; the same command starts again"
            in output)
    assert "Traceback" not in output


@pytest.mark.slow
@pytest.mark.parametrize("content", [b"", b'{"fingerprint": "ab', b"\xff\xfe"], ids=["empty", "torn", "not_utf8"])
def test_a_cut_warm_start_json_is_named_and_the_warm_start_redone(warm_start_runs, content):
    name = f"cut_{len(content)}"
    done = warm_start_runs.root / name / "warm_start" / "warm_start.json"
    done.parent.mkdir(parents=True)
    (done.parent / MARKER).write_text('{"kind": "warm start"}')  # the folder is the stage's (it claimed it first)
    done.write_bytes(content)
    launched = warm_start_runs(name, "--config.sft.steps=2", "--config.sft.log_every=1")
    launched.process.wait(TIMEOUT_S)
    output = launched.output()
    assert launched.process.returncode == 0, output[-4000:]
    assert f"warm start: {done} is unreadable (" in output
    assert "warm start: done in" in output
    assert done.read_text().startswith('{\n  "fingerprint": ')
