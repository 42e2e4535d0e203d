"""Documents a remote retriever should never send (issue 44): contents null or an object, and huge passages. A bad
document is dropped and counted where it enters (`search.types.received`), a huge one cut there, and an
observation is tokenized from a bounded prefix: the run goes on and says what it dropped, and a stop costs no
more than with normal documents."""
import asyncio
import json
import signal
import time

import pytest

from llds_jax.protocol import MAX_CHARS_PER_TOKEN, Action
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.stats import RolloutStats
from llds_jax.rollout.steps import AgentSteps, Conversation
from llds_jax.rollout.trajectory import Lineage, Turn
from llds_jax.search.http import HttpRetriever
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.types import MAX_DOCUMENT_CHARS
from tests.e2e.runs import steps_saved
from tests.reliability.scripted_retriever import PASSAGE, ScriptedRetriever
from tests.reliability.test_stop_phases import default_policy
from tests.reliability.test_stops import TIMEOUT_S, assert_stopped_in_time

HUGE = "Huge\n" + "word " * 6_000_000  # 30 MB of passage text


def search(server, queries):
    async def run():
        retriever = HttpRetriever(server.url, policy=RequestPolicy(timeout_s=60.0, max_retries=0))
        try:
            return await retriever.search(queries, 4)
        finally:
            await retriever.close()
    return asyncio.run(run())


def test_null_and_object_contents_are_dropped_and_counted_and_huge_ones_cut():
    with ScriptedRetriever() as server:
        server.documents = [None, PASSAGE, {"text": "an object"}, HUGE]
        results = search(server, ["q1", "q2"])
    for result in results:
        assert result.error is None and result.bad_documents == 2
        assert [d.contents for d in result.docs] == [PASSAGE, HUGE[:MAX_DOCUMENT_CHARS]]


def test_a_rollout_step_counts_bad_documents_and_tokenizes_a_bounded_prefix(qwen_tokenizer):
    """The agent's search and observation on the same answers: two bad documents counted, the observation cut to
    max_observation_tokens within a second (the 30 MB text tokenized whole took minutes and gigabytes)."""
    config = AgentConfig(max_observation_tokens=128, max_context_tokens=4096, max_response_tokens=4096)
    stats = RolloutStats()
    with ScriptedRetriever() as server:
        server.documents = [None, HUGE]
        retriever = HttpRetriever(server.url, policy=RequestPolicy(timeout_s=60.0, max_retries=0))
        steps = AgentSteps(qwen_tokenizer, retriever, config, stats)

        async def run():
            try:
                return await steps.search(["q"])
            finally:
                await retriever.close()
        ((observation, error),) = asyncio.run(run())
    assert error is None and stats.bad_documents == 1
    conversation = Conversation([1, 2, 3], Lineage(0, 0, (0, 0)))
    start = time.perf_counter()
    turn = Turn((5,), (0.0,), "<search>q</search>", Action("search", "q"), num_sampled=1)
    obs_ids, truncated = steps.append_turn(conversation, turn, observation, None)
    assert time.perf_counter() - start < 5.0
    assert truncated and len(obs_ids) == 128 and stats.observation_tokens == 128
    assert obs_ids == qwen_tokenizer.encode(observation[:128 * MAX_CHARS_PER_TOKEN], add_special_tokens=False)[:128]
    assert json.dumps(obs_ids)  # plain ints


def stop_while_documents_arrive(searching_runs, name: str, documents: list[object] | None) -> float:
    """Runs `name` with a retriever that serves `documents` for every query (None: its normal passages) and sends
    SIGTERM once it has written the first answer of step 2's rollout, while the run still receives and parses it;
    asserts exit status 0 within STOP_WITHIN_S with step 1 saved. Returns the seconds from the signal to the exit."""
    launched, sent = [], []
    with ScriptedRetriever() as server:
        server.documents = documents

        def sigterm_in_step_2(queries):  # the first answer after step 1's console line: step 2's first session
            if not sent and "step 1/3" in launched[0].output():
                launched[0].process.send_signal(signal.SIGTERM)
                sent.append(time.monotonic())

        server.on_answered = sigterm_in_step_2
        # up to 480 MB per answer: past the client's default retriever.max_response_bytes (64 MiB), which would
        # fail those searches before the cut where documents enter is reached
        launched.append(searching_runs.start({**default_policy(server), "max_response_bytes": 1 << 30}, name))
        try:
            launched[0].process.wait(TIMEOUT_S)
            assert sent, launched[0].output()[-4000:]
            stopped_s = time.monotonic() - sent[0]
            output = assert_stopped_in_time(launched[0], sent[0])
        finally:  # a run that grinds through 30 MB documents would go on at gigabytes of memory
            launched[0].process.kill()
    assert "stop requested during the rollout of step 2: saved the state before it, exiting" in output
    assert "training stopped after step 1 of 3" in output
    assert steps_saved(searching_runs.run_dir(name)) == [1]
    return stopped_s


@pytest.mark.slow
def test_sigterm_while_30_mb_documents_arrive_stops_the_run_as_fast_as_normal_ones(searching_runs):
    """A run whose retriever answers every query with a 30 MB passage (up to 480 MB per request of 16 queries), the
    start-up check and step 1 included, gets SIGTERM as step 2's first answer is written: exit status 0 within
    STOP_WITHIN_S, as with normal documents (before issue 44 the stop came 241 s after the signal; with the cuts
    taken out step 1, tokenizing each 30 MB observation whole, does not end within TIMEOUT_S)."""
    normal_s = stop_while_documents_arrive(searching_runs, "normal_documents_stop", None)
    huge_s = stop_while_documents_arrive(searching_runs, "huge_documents_stop", [HUGE])
    print(f"SIGTERM to exit: {huge_s:.1f} s with 30 MB documents, {normal_s:.1f} s with normal ones")
