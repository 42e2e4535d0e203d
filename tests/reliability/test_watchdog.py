"""Runs that cannot make progress end with one clear line (exit status 2) instead of training on nothing: a
retriever that keeps failing (the run is saved and resumes once it is back) and a model whose parameters are not
finite (every update skipped). And the retry budget of one failing search batch is the one the docs state."""
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from llds_jax.model import hf_io
from llds_jax.search.factory import resolve_config
from llds_jax.search.retry import RequestPolicy
from llds_jax.train.watchdog import NonFiniteError, Watchdog
from tests.e2e.runs import finish, read_metrics, steps_saved
from tests.reliability.scripted_retriever import ScriptedRetriever

TIMEOUT_S = 300


def error_line(launched) -> str:
    """The process's last line, after asserting it ended with exit status 2 and without a traceback."""
    launched.process.wait(TIMEOUT_S)
    output = launched.output()
    assert launched.process.returncode == 2, output[-4000:]
    assert "Traceback" not in output
    return output.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_retriever_failing_for_two_steps_ends_the_run_saved_and_it_resumes(searching_runs):
    run_dir = searching_runs.run_dir("outage")
    with ScriptedRetriever() as server:
        launched = None

        def outage_from_step_2(queries):  # every search after step 1's console line fails (HTTP 503)
            if "step 1/3" in launched.output():
                server.failing = True

        server.on_request = outage_from_step_2
        launched = searching_runs.start(server.config(), "outage", rollout__max_failed_search_steps=2)
        line = error_line(launched)
        assert re.fullmatch(
            r"llds_jax: error: the retriever failed more than 50% of the searches in 2 steps in a row "
            r"\(rollout.search_failure_rate, rollout.max_failed_search_steps\); last error: http backend at "
            + re.escape(server.url) + r": gave up after 1 attempt, last error: HttpStatusError: HTTP 503: "
            r'\{"error": "scripted outage"\}; the run is saved before step 3: the same command resumes there',
            line), line
        # Step 2 trained on failed searches (one failing step is tolerated); step 3's did not reach the updates.
        assert steps_saved(run_dir) == [2]
        assert [r["rollout/retriever_errors"] > 0 for r in read_metrics(run_dir)] == [False, True]

        server.on_request, server.failing = None, False
        outputs = finish([searching_runs.start(server.config(), "outage", rollout__max_failed_search_steps=2)],
                         TIMEOUT_S)
    assert "resumed from step 2" in outputs[0]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3] and records[2]["rollout/retriever_errors"] == 0


@pytest.mark.slow
def test_a_model_with_nan_weights_stops_after_the_skipped_updates_naming_the_parameter(searching_runs, policy,
                                                                                      tmp_path):
    broken = str(tmp_path / "nan_policy")
    shutil.copytree(policy[0], broken)
    model = hf_io.load_model(policy[0], dtype="float32", param_dtype="float32")
    down_proj = np.asarray(model.layers.down_proj.get_value()).copy()
    down_proj[0, 0, 0] = np.nan
    model.layers.down_proj.set_value(down_proj)
    hf_io.save_model(model, broken)
    with ScriptedRetriever() as server:
        launched = searching_runs.start(server.config(), "nan", "--config.model.path=" + broken,
                                        optim__max_skipped_updates=40)
        line = error_line(launched)
    # 32 updates a step, all skipped: the run ends at step 1 (issue 58), before the 40th skipped update in a row.
    assert line == ("llds_jax: error: every update of step 1 (32) was skipped for a non-finite loss or gradient; "
                    "the parameter layers.down_proj holds non-finite values; step 1 is not saved")
    records = read_metrics(searching_runs.run_dir("nan"))
    assert [(r["step"], r["actor/nonfinite"]) for r in records] == [(1, 32)]
    assert steps_saved(searching_runs.run_dir("nan")) == []  # a state that is the problem is not saved


def test_docs_state_the_retry_budget_of_the_default_settings(repo_root):
    """docs/retrieval.md's worst case of a failing batch is the one the code's defaults give (it once said 18.5 s
    while the code took 43.5 s)."""
    defaults = resolve_config({"backend": "http", "url": "http://127.0.0.1:1/retrieve"})
    policy = RequestPolicy.of(defaults)
    with open(os.path.join(repo_root, "docs", "retrieval.md")) as f:
        stated = re.search(r"seconds \(([\d.]+) s with the defaults\)", f.read())
    assert stated is not None and float(stated.group(1)) == policy.worst_case_s == 43.5


def test_a_step_whose_every_update_was_skipped_ends_the_run_naming_it():
    """Issue 58 item 3: a resumed run from damaged weights skipped all 4 updates of its step, exited 0 and saved the
    step over the good checkpoint (the check waited for optim.max_skipped_updates=20 in a row)."""
    params = {"w": jnp.ones(3)}
    watchdog = Watchdog(search_failure_rate=0.5, max_failed_search_steps=3, max_skipped_updates=20)
    watchdog.count_updates(np.array([1, 0, 1, 1]))  # one update went through: the run goes on
    watchdog.check_updates(params, 2)
    watchdog.count_updates(np.array([1, 1, 1, 1]))
    with pytest.raises(NonFiniteError, match=r"^every update of step 3 \(4\) was skipped for a non-finite loss or "
                                             r"gradient; every parameter is finite: the loss or its gradient is "
                                             r"not; step 3 is not saved$"):
        watchdog.check_updates(params, 3)
    off = Watchdog(search_failure_rate=0.5, max_failed_search_steps=3, max_skipped_updates=0)
    off.count_updates(np.array([1, 1, 1, 1]))
    off.check_updates(params, 1)  # optim.max_skipped_updates = 0 turns the check off
