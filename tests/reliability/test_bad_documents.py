"""Documents a remote retriever should never send (issue 44): contents null or an object, and huge passages. A bad
document is dropped and counted where it enters (`search.types.received`), a huge one cut there, and an
observation is tokenized from a bounded prefix: the run goes on and says what it dropped."""
import asyncio
import json
import time

from llds_jax.protocol import Action
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.steps import MAX_CHARS_PER_TOKEN, AgentSteps, Conversation
from llds_jax.rollout.trajectory import Turn
from llds_jax.search.http import HttpRetriever
from llds_jax.search.retry import RequestPolicy
from llds_jax.search.types import MAX_DOCUMENT_CHARS
from tests.reliability.scripted_retriever import PASSAGE, ScriptedRetriever

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
    timing = {"searches": 0.0, "search_calls_s": 0.0, "bad_documents": 0.0, "prompt_tokens": 0.0,
              "observation_tokens": 0.0}
    with ScriptedRetriever() as server:
        server.documents = [None, HUGE]
        retriever = HttpRetriever(server.url, policy=RequestPolicy(timeout_s=60.0, max_retries=0))
        steps = AgentSteps(qwen_tokenizer, retriever, config, timing)

        async def run():
            try:
                return await steps.search(["q"])
            finally:
                await retriever.close()
        ((observation, error),) = asyncio.run(run())
    assert error is None and timing["bad_documents"] == 1
    conversation = Conversation([1, 2, 3])
    start = time.perf_counter()
    turn = Turn((5,), (0.0,), "<search>q</search>", Action("search", "q"), num_sampled=1)
    obs_ids, truncated = steps.append_turn(conversation, turn, observation, None)
    assert time.perf_counter() - start < 5.0
    assert truncated and len(obs_ids) == 128 and timing["observation_tokens"] == 128
    assert obs_ids == qwen_tokenizer.encode(observation[:128 * MAX_CHARS_PER_TOKEN], add_special_tokens=False)[:128]
    assert json.dumps(obs_ids)  # plain ints
