"""The Search-R1 multi-turn agent loop over a sampler session and an async retriever.

Per batch of questions: prompts (protocol.chat_prompt_ids, last `max_prompt_tokens` kept) are encoded once into
the KV cache; then up to `max_turns` turns with search and one final turn in which a search is not executed:

  1. every unfinished sequence decodes until its text holds `</search>` or `</answer>`, a stop token (EOS), or
     `max_turn_tokens` new tokens;
  2. the turn is cut (protocol.cut_turn_tokens): the kept, trained tokens are the sampled ones up to the token that
     completes the cut. The stop token is never kept (Search-R1 drops the end-of-turn token too). Sampled tokens
     after the cut are rolled back out of the KV cache;
  3. the action is parsed from the cut text: `answer` ends the sequence; `search` queries go to the retriever in
     batched calls; no valid action appends the invalid-action message;
  4. the observation is tokenized (add_special_tokens=False), cut to `max_observation_tokens` (counted per turn)
     and appended to the KV cache with model.extend; the conversation is never re-encoded.

Retrieval overlaps decoding: the session runs on a worker thread and reports each sequence's turn as soon as it
ends (`Session.decode_turn(..., on_finished)`, after every decode chunk); the sequences that ended in one chunk are
cut, parsed and their searches sent as one batched call on the event loop while the other rows go on decoding. The
searches still in flight when the last row ends, plus those of sequences the session did not report, are awaited
before the observations are appended. Each query's result does not depend on the call it went in, so the
trajectories are exactly those of one batched call per turn after decoding; only the wait shrinks.

A failed search (an error result for that query, an exception or a timeout of the whole call) gives that
sequence the observation `steps.SEARCH_ERROR_OBSERVATION` (an information block holding one "Search failed: ..." line)
and records the error; the other sequences are unaffected.

A session's turns run in `turn_loop.TurnLoop`; tree rollouts (`rollout.trees`, `llds_jax.rollout.tree`) run it
over the chains, then over each round of forks.

Context caps differ from Search-R1 in one way: Search-R1 left-truncates the rolling context to 4096 tokens; with a
KV cache we instead end a sequence cleanly (end reason "context_full") when its next turn or observation would
take prompt + response past `max_context_tokens` or the response past `max_response_tokens`. A turn's budget is
shortened to what fits.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp

from llds_jax.data.qa import QAExample
from llds_jax.rollout import continuous, tree
from llds_jax.rollout.config import AgentConfig
from llds_jax.rollout.driver import Driver
from llds_jax.rollout.paged_sampler import PagedSampler
from llds_jax.rollout.interfaces import TurnSampler
from llds_jax.rollout.steps import AgentSteps
from llds_jax.rollout.trajectory import Trajectory, rollout_metrics
from llds_jax.rollout.turn_loop import TurnLoop
from llds_jax.search.types import Retriever


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Finished trajectories (in input order) and batch metrics (means, shares, seconds and tokens/s).

    Seconds: `rollout_s` (the whole rollout) = `prefill_s` (prompt prefill and observation extends on device)
    + `decode_s` (decode chunks on device, and their dispatch) + `search_s` (waiting for search results after
    decoding: retrieval on the critical path) + `host_s` (the rest: text checks between chunks, cutting and parsing
    turns, tokenizing observations, building trajectories). `search_calls_s` sums the retriever calls' own
    durations, most of them hidden behind decoding. `decode_occupancy`: sampled tokens / (decode steps x device
    batch rows), the share of decode rows doing real work (0 for sessions that do not count them).

    The budget (counts): `sampled_tokens` (tokens generated, rolled-back ones included), `prompt_tokens` (the
    conversations' prompts, each encoded once per conversation; `rollout.shared_prompt_prefill` encodes each distinct
    prompt once on device), `observation_tokens` (appended to the cache), `searches` (queries sent) and
    `trajectories`; with `config.trees`, `forked_prefix_tokens` (the turn and observation tokens each fork shares
    with its parent up to its node: sampled once, trained again in every leaf that holds them).

    On the paged engine (`PagedSampler`) also: `step_calls_T` and `step_tokens_T`, the step program of token bucket
    T's calls and the real tokens of their ragged batches (every bucket of the run, 0 when not run),
    `shared_prompt_tokens` (prompt tokens a sample took from its group's first instead of encoding them) and
    `page_copies` (pages copied on write).

    `stopped`: the rollout was abandoned on a stop request (`rollout(stopping=...)`): no trajectories, no metrics.
    """

    trajectories: list[Trajectory]
    metrics: dict[str, float]
    stopped: bool = False

    def __repr__(self) -> str:
        # Short: asyncio.Runner.run formats the finished task, result included, when it restores the SIGINT
        # handler; the full repr of thousands of trajectories' arrays took longer than the rollout's decoding.
        return f"Rollout(<{len(self.trajectories)} trajectories>, metrics={self.metrics!r})"


END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")  # Qwen2.5, Llama-3


def turn_stop_ids(tokenizer) -> tuple[int, ...]:
    """Token ids that end a turn: the tokenizer's EOS plus the end-of-turn / end-of-text tokens of the Qwen2.5 and
    Llama-3 vocabularies it has (a base model prompted with a chat template may close its turn with either)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    if not ids:
        raise ValueError("the tokenizer of model.tokenizer_path (default: model.path) has no EOS token: set "
                         "eos_token in its tokenizer_config.json")
    return tuple(sorted(ids))


def rollout(sampler: TurnSampler, params, tokenizer, retriever: Retriever, examples: Sequence[QAExample],
            rng: jax.Array, config: AgentConfig, runner: Optional[asyncio.Runner] = None, first_sequence: int = 0,
            between_sessions: Optional[Callable[[], None]] = None,
            stopping: Optional[Callable[[], bool]] = None) -> Rollout:
    """Runs the agent loop for `examples` (repeat an example for several samples; they share its uid).

    Args:
      sampler: opens the sessions (`interfaces.TurnSampler`, e.g. `sampler.Sampler`); a session's `decode_turn`
        runs on a worker thread; a session that never calls `on_finished` makes the searches start after decoding.
      params: the policy parameters (`nnx.split(model)[1]`).
      tokenizer: a Hugging Face tokenizer (prompt, turn text, observations).
      retriever: the async retriever (`search.types.Retriever`).
      rng: a PRNG key; example i samples with the global sequence id first_sequence + i (per session when
        `config.max_batch_size` splits the examples, see `_session_stream`), see `sampler.Sampler.start`.
      runner: an `asyncio.Runner` to reuse one event loop across calls (async retriever clients bind to a
        loop); a fresh loop per call without one.
      first_sequence: the global sequence id of examples[0], e.g. this host's first row of a global batch on
        several hosts, so that the hosts together sample what one process would.
      between_sessions: called before every sampler session but the first (`config.max_batch_size` splits the
        examples into sessions); what it raises ends the rollout (the trainer's stop check: a preemption notice
        then waits for one session, not the whole rollout). Not called with `config.continuous_batching` (one
        batch serves every example).
      stopping: whether a stop was requested on this host (the trainer's PreemptionGuard): once it is, searches
        in flight are abandoned, no new turn or session starts, and the Rollout comes back `stopped` (the caller
        agrees on the stop with the other hosts: this one returns at once, they finish theirs).
    With `config.continuous_batching` the examples run in one continuous batch (`continuous`; the sampler must be a
    `sampler.Sampler`), each sampling from the stream it has here. With `config.trees` each session's examples (whole
    groups of `config.tree_group` samples of one question) grow as trees (`tree`; a `sampler.Sampler`).
    Returns a Rollout with one trajectory per example, in order.
    """
    coro = rollout_async(sampler, params, tokenizer, retriever, examples, rng, config, first_sequence,
                         between_sessions, stopping)
    return runner.run(coro) if runner is not None else asyncio.run(coro)


async def rollout_async(sampler: TurnSampler, params, tokenizer, retriever: Retriever,
                        examples: Sequence[QAExample], rng: jax.Array, config: AgentConfig, first_sequence: int = 0,
                        between_sessions: Optional[Callable[[], None]] = None,
                        stopping: Optional[Callable[[], bool]] = None) -> Rollout:
    """`rollout` as a coroutine."""
    if not examples:
        raise ValueError("rollout: no examples")
    size = config.max_batch_size or len(examples)
    trajectories: list[Trajectory] = []
    timing = {"prefill_s": 0.0, "decode_s": 0.0, "search_s": 0.0, "search_calls_s": 0.0, "sampled_tokens": 0.0,
              "prompt_tokens": 0.0, "prompts_cut": 0.0, "observation_tokens": 0.0, "searches": 0.0,
              "bad_documents": 0.0,
              "decode_sampled_tokens": 0.0, "decode_row_steps": 0.0}
    if config.trees:
        timing["forked_prefix_tokens"] = 0.0
    steps = AgentSteps(tokenizer, retriever, config, timing, stopping)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-decode") as decode_thread:
        if isinstance(sampler, PagedSampler):
            engine = sampler.engine(params, steps.stop_matcher())
            policy = "tree" if config.trees else "continuous" if config.continuous_batching else "barrier"
            trajectories = await Driver(engine, steps, examples, decode_thread).run(policy, rng, first_sequence,
                                                                                  between_sessions)
            counts = engine.counts
            timing["decode_s"] += counts.device_s
            timing["decode_sampled_tokens"] += counts.sampled_tokens
            timing["decode_row_steps"] += counts.sample_slots
            timing.update(shared_prompt_tokens=float(counts.shared_prompt_tokens), page_copies=float(counts.page_copies))
            for bucket in sampler.engine_config.token_budgets:  # every bucket, run or not: the same keys on each host
                timing[f"step_calls_{bucket}"] = float(counts.calls.get(bucket, 0))
                timing[f"step_tokens_{bucket}"] = float(counts.batch_tokens.get(bucket, 0))
        elif config.continuous_batching:
            keys_n = jnp.concatenate([sampler.sequence_keys(*_session_stream(rng, first_sequence + first,
                                                                             config.max_batch_size),
                                                            len(examples[first:first + size]))
                                      for first in range(0, len(examples), size)])
            trajectories = await continuous.run(sampler, params, steps, examples, keys_n, size, decode_thread)
        else:
            for first in range(0, len(examples), size):
                if first and between_sessions is not None:
                    between_sessions()
                if steps.stopping():
                    break
                batch = examples[first:first + size]
                stream = _session_stream(rng, first_sequence + first, config.max_batch_size)
                if config.trees:
                    trajectories += await tree.run(sampler, params, steps, batch, decode_thread, *stream)
                    continue
                convs = [steps.conversation(ex) for ex in batch]
                session = sampler.start(params, [c.prompt_ids for c in convs], *stream)
                await TurnLoop(steps, convs, decode_thread).run(session)
                if not steps.stopping():  # unfinished conversations: the rollout is abandoned
                    trajectories += steps.trajectories(batch, convs)
    if steps.stopping():
        return Rollout([], {}, stopped=True)
    elapsed = time.perf_counter() - start
    metrics = rollout_metrics(trajectories)
    host_s = elapsed - timing["prefill_s"] - timing["decode_s"] - timing["search_s"]
    decode_sampled, row_steps = timing.pop("decode_sampled_tokens"), timing.pop("decode_row_steps")
    metrics.update(timing, rollout_s=elapsed, host_s=max(host_s, 0.0), trajectories=float(len(trajectories)),
                   sampled_tokens_per_s=timing["sampled_tokens"] / max(timing["decode_s"], 1e-9),
                   decode_occupancy=decode_sampled / row_steps if row_steps else 0.0)
    return Rollout(trajectories, metrics)


def _session_stream(rng: jax.Array, first_sequence: int, max_batch_size: int) -> tuple[jax.Array, int]:
    """The (rng, first_sequence) of the session whose first example has global id `first_sequence`.

    Without sessions (max_batch_size 0) that is (rng, first_sequence). With sessions of max_batch_size rows, global
    session k = first_sequence // max_batch_size samples with fold_in(rng, k) from row first_sequence % max_batch_size
    on, so hosts whose share of a global batch is a multiple of max_batch_size sample what one process would.
    """
    if not max_batch_size:
        return rng, first_sequence
    return jax.random.fold_in(rng, first_sequence // max_batch_size), first_sequence % max_batch_size
