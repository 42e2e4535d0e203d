"""Over-long questions in a real run (issue 66): a training file whose every question is 1 MB (a pasted page before
the question). Before, each was fitted to rollout.max_prompt_tokens once per sample (seconds each), the barrier
policy fitted a whole session's prompts before its first stop check, and a SIGTERM then took minutes to stop the
run. Now a question is bounded as it is read (one warning line), its prompt is fitted once per step, each cut prompt
is counted on the budget line, and a SIGTERM while a session's prompts are fitted ends the run within
STOP_WITHIN_S."""
import re

import pytest

from llds_jax.data import qa
from tests.reliability.scripted_retriever import ScriptedRetriever
from tests.reliability.test_stops import TIMEOUT_S, assert_stopped_in_time
from tests.e2e.runs import read_metrics, steps_saved

PROMPTS = 16  # data.prompts_per_step in tests/reliability/conftest.py: every question of the file, every step
SAMPLES = 2  # data.samples_per_prompt there
MB = 1_000_000


def long_questions(world_train: str, path: str) -> str:
    """A QA file of the world's first PROMPTS training questions, each after a page of text: 1 MB in all."""
    examples = []
    for example in qa.read_qa(world_train)[:PROMPTS]:
        page = ("The archive page repeats its notes. " * (MB // 36))[:MB - len(example.question) - 1]
        examples.append(qa.QAExample(example.uid, f"{page} {example.question}", example.golden_answers,
                                     example.data_source, example.id))
    qa.write_qa_parquet(path, examples, split="train")
    return path


@pytest.mark.slow
def test_1_mb_questions_are_fitted_once_per_step_and_a_sigterm_while_fitting_stops_the_run(searching_runs, world,
                                                                                          tmp_path):
    train = long_questions(world[1]["train.parquet"], str(tmp_path / "long_questions.parquet"))
    name = "long_questions_stop"
    with ScriptedRetriever() as server:
        launched = searching_runs.start(server.config(), name, launcher=("-m", "tests.reliability.sigterm_in_fit", "2"),
                                        data__train_files=[train])
        try:
            launched.process.wait(TIMEOUT_S)
            signalled = re.search(r"SIGTERM sent at monotonic (\S+)", launched.output())
            assert signalled, launched.output()[-4000:]
            output = assert_stopped_in_time(launched, float(signalled.group(1)))
        finally:  # before issue 66 the run could outlive TIMEOUT_S, fitting 1 MB questions
            launched.process.kill()
    assert ("the questions of 16 rows are longer than 65,536 characters; each keeps its last 65,536 (its start cut"
            " as the prompt of rollout.max_prompt_tokens = 256 would cut it, keeping the same tokens)") in output
    step_1 = output.split("STEP 1 STARTS")[1].split("STEP 2 STARTS")[0]
    fits = re.findall(r"^FIT (\d+)$", step_1, re.MULTILINE)
    assert len(fits) == PROMPTS and all(int(chars) == 65_536 for chars in fits)  # once per prompt, not per sample
    assert "step 1 budget: " in step_1
    assert f"{PROMPTS * SAMPLES} prompts cut to rollout.max_prompt_tokens (their questions' start)" in step_1
    assert "stop requested during the rollout of step 2: saved the state before it, exiting" in output
    assert steps_saved(searching_runs.run_dir(name)) == [1]
    assert [r["step"] for r in read_metrics(searching_runs.run_dir(name))] == [1]
