"""An over-long question (issue 66): its prompt is fitted once per rollout, not once per sample of its group (a 1 MB
question took 6.9 s per fit, 8 fits per group), and a stop requested while a session's prompts are fitted ends the
admissions at once (the barrier policy admitted the whole session before its first stop check)."""
import asyncio
import concurrent.futures

import jax
import pytest

from llds_jax import protocol
from llds_jax.rollout import driver as driver_lib
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.stats import RolloutStats
from llds_jax.rollout.steps import AgentSteps
from tests.rollout.scripted_engine import ScriptedEngine
from tests.rollout.test_agent import example
from tests.rollout.test_driver import CountingRetriever, policy

GROUP = 8
CONFIG = AgentConfig(max_turns=2, max_turn_tokens=40, max_prompt_tokens=200, max_context_tokens=400)
# 1 MB of words, then the question the scripted policy answers (its end: what the prompt keeps).
LONG_QUESTION = ("filler words of a pasted page " * 40_000)[:1_000_000 - len(" question w0")] + " question w0"


@pytest.fixture
def fits(monkeypatch):
    """The questions protocol.fit_prompt is called with, in order (the real function runs)."""
    questions = []
    fit_prompt = protocol.fit_prompt

    def counted(tokenizer, question, *args, **kwargs):
        questions.append(question)
        return fit_prompt(tokenizer, question, *args, **kwargs)

    monkeypatch.setattr(protocol, "fit_prompt", counted)
    return questions


def rollout(tokenizer, examples, stopping=None):
    """The barrier driver's trajectories of `examples` (one session, groups of GROUP), its engine and stats."""
    engine = ScriptedEngine(tokenizer, policy, slots=64)
    stats = RolloutStats()
    agent_steps = AgentSteps(tokenizer, CountingRetriever(), CONFIG, stats, stopping)

    async def go():
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            return await driver_lib.Driver(engine, agent_steps, examples, thread, GROUP).run(
                "barrier", jax.random.key(0))

    return asyncio.run(go()), engine, stats


def test_a_group_of_a_1_mb_question_is_fitted_once(qwen_tokenizer, fits):
    long_group = [example(0, LONG_QUESTION, ("w0",))] * GROUP
    short_group = [example(1, "question w1", ("w1",))] * GROUP
    trajectories, _, stats = rollout(qwen_tokenizer, long_group + short_group + long_group)  # a repeat too
    assert fits == [LONG_QUESTION, "question w1"]
    want, cut = protocol.fit_prompt(qwen_tokenizer, LONG_QUESTION, CONFIG.max_prompt_tokens)
    assert cut > 0 and len(want) == CONFIG.max_prompt_tokens
    long_trajectories = trajectories[:GROUP] + trajectories[2 * GROUP:]
    assert all(t.prompt_ids == tuple(want) for t in long_trajectories)
    assert [t.final_answer for t in trajectories] == ["w0"] * GROUP + ["w1"] * GROUP + ["w0"] * GROUP
    # Each conversation still counts its prompt: its tokens and, cut, in prompts_cut (the budget line's count).
    assert stats.prompts_cut == 2 * GROUP
    assert stats.prompt_tokens == sum(len(t.prompt_ids) for t in trajectories)


def test_a_stop_during_a_sessions_fits_ends_its_admissions(qwen_tokenizer, fits):
    """The stop arrives while the first prompt is fitted (as a SIGTERM would): no other sequence is admitted."""
    examples = [example(g, f"{LONG_QUESTION} {g}", ("w0",)) for g in range(2) for _ in range(GROUP)]
    trajectories, engine, _ = rollout(qwen_tokenizer, examples, stopping=lambda: bool(fits))
    assert trajectories == [] and len(fits) == 1
    assert [(call, seq) for _, call, seq in engine.events] == [("add", 0)]
