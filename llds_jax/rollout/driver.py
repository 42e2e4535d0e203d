"""The Search-R1 agent loop over the rollout engine (`rollout.interfaces.Engine`), under one of three scheduling
policies that share one driver:

  barrier      turn-synchronous sessions of `max_batch_size` conversations (all at once when 0): every
               conversation of a session samples its turn, the searches are awaited, then every observation is
               appended and the next turn starts; the next session starts when the last conversation has ended.
  continuous   one stream: a conversation enters as soon as the engine has a slot and pages for it, and each
               conversation's observation is appended as soon as its search is back, while the others decode.
  tree         barrier sessions of whole trees (`rollout.trees`, Tree-GRPO): the chains, then each round's forks
               from the nodes `tree.choose_nodes` picks (an engine fork shares its parent's pages).

A turn that ends is cut and parsed at once (`steps.AgentSteps.close_turn`) and its search queued; the queries that
are ready go to the retriever in one call while the engine decodes (`SearchQueue`: one call in flight at a time, so a
host index scans its rows once per call, not once per decode chunk). A query's result does not depend on the call
that carried it, and a conversation samples from its own PRNG stream in calls aligned to its turn's start, so the
policies give the same trajectories; only the waiting differs.

A partial step (`rollout.partial`, `rollout.partial.StepPlan`) resumes its carried conversations first (their
tokens re-admitted, their KV recomputed, their PRNG streams going on) and ends once the plan's groups are complete
(the cut: after each turn round of the barrier policy, after each engine step of the continuous one); the step's
trajectories and what it carries are `partial.settle`'s.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import numpy as np

from llds_jax.data.qa import QAExample
from llds_jax.rollout import tree as tree_lib
from llds_jax.rollout.interfaces import Engine, SampledTurn
from llds_jax.rollout.partial import CarriedConversation, StepPlan
from llds_jax.rollout.steps import AgentSteps, Conversation
from llds_jax.rollout.trajectory import Lineage, Trajectory, Turn

POLICIES = ("barrier", "continuous", "tree")

def sequence_keys(rng: jax.Array, ids: Sequence[int]) -> np.ndarray:
    """uint32 [n, 2] the key data of fold_in(rng, id) for each global sequence id: a sequence's PRNG stream."""
    if not jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.wrap_key_data(rng)
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(np.asarray(ids, np.uint32))
    return np.asarray(jax.random.key_data(keys))


def session_stream(rng: jax.Array, first_sequence: int, max_batch_size: int) -> tuple[jax.Array, int]:
    """The (rng, first row) of the session whose first sequence has global id `first_sequence`.

    Without sessions (max_batch_size 0) that is (rng, first_sequence). With sessions of max_batch_size sequences,
    global session k = first_sequence // max_batch_size samples with fold_in(rng, k) from row
    first_sequence % max_batch_size on, so hosts whose share of a global batch is a multiple of max_batch_size
    sample what one process would.
    """
    if not max_batch_size:
        return rng, first_sequence
    return jax.random.fold_in(rng, first_sequence // max_batch_size), first_sequence % max_batch_size


class SearchQueue:
    """Searches of closed turns, sent in as few retriever calls as the engine's pace allows: at most one call in
    flight; the queries queued meanwhile go out together when it is back."""

    def __init__(self, agent_steps: AgentSteps):
        self.agent_steps = agent_steps
        self._queued: list[tuple[int, str]] = []
        self._call: Optional[tuple[list[int], asyncio.Future]] = None

    @property
    def busy(self) -> bool:
        return self._call is not None or bool(self._queued)

    def submit(self, seq: int, query: str) -> None:
        """Queues a query; it goes out with the others queued at the next `collect` or `wait` (the turns closed by
        one engine step search in one call)."""
        self._queued.append((seq, query))

    def collect(self) -> dict[int, tuple[str, Optional[str]]]:
        """The finished call's results, sequence -> (observation, error); sends what queued meanwhile."""
        results = {}
        if self._call is not None and self._call[1].done():
            seqs, future = self._call
            self._call = None
            results = dict(zip(seqs, future.result()))
        self._send()
        return results

    async def wait(self) -> dict[int, tuple[str, Optional[str]]]:
        """Waits for the call in flight (seconds counted in the rollout's search_s), then collects."""
        if self._call is not None:
            start = time.perf_counter()
            await asyncio.wait({self._call[1]})
            self.agent_steps.stats.search_s += time.perf_counter() - start
        return self.collect()

    def cancel(self) -> None:
        if self._call is not None:
            self._call[1].cancel()

    def _send(self) -> None:
        if self._call is None and self._queued:
            seqs, queries = [s for s, _ in self._queued], [q for _, q in self._queued]
            self._queued = []
            self._call = (seqs, asyncio.ensure_future(self.agent_steps.search(queries)))


class Driver:
    """One rollout's conversations over an engine (see the module docstring).

    Args:
      engine: the rollout engine.
      agent_steps: the protocol's steps and the rollout's stats.
      examples: one conversation each; sequence i is examples[i].
      decode_thread: the worker that runs `engine.step`, so that searches go out on the event loop meanwhile.
      group_size: consecutive samples of one GRPO group (`Lineage.group` is global sequence id // group_size).
      version: the policy version of the turns it samples (`Turn.version`: the training step).
      plan: a partial step's plan (its examples are `plan.examples`, its carried conversations resumed first); None:
        every example runs to its end.
      searches: the queue its searches go through (default: a `SearchQueue` over `agent_steps`' retriever).
    """

    def __init__(self, engine: Engine, agent_steps: AgentSteps, examples: Sequence[QAExample],
                 decode_thread: concurrent.futures.Executor, group_size: int = 1, version: int = 0,
                 plan: Optional[StepPlan] = None, searches: Optional[SearchQueue] = None):
        self.engine, self.agent_steps, self.decode_thread = engine, agent_steps, decode_thread
        self.examples = list(examples)
        self.config, self.group_size, self.version, self.plan = agent_steps.config, group_size, version, plan
        self._carried = plan.carried if plan is not None else {}
        self._ended_in_group: dict[int, int] = {}  # group position -> its conversations that ended
        self._complete_groups = 0
        self.first_sequence = 0  # the global sequence id of examples[0] (`run`)
        self.convs: dict[int, Conversation] = {}
        self.searches = searches or SearchQueue(agent_steps)
        self._searching: dict[int, Turn] = {}  # closed turns waiting for their search
        self._ready: dict[int, tuple[Turn, Optional[str], Optional[str]]] = {}  # turn, observation, error
        self._truncations = 0
        self._in_engine: set[int] = set()  # sequences holding a slot in the engine

    async def run(self, policy: str, rng: jax.Array, first_sequence: int = 0,
                  between_sessions: Optional[Callable[[], None]] = None) -> list[Trajectory]:
        """The trajectories of every example, in order ([] once a stop is requested).

        Example i is global sequence first_sequence + i: it samples from the stream its session gives it
        (`session_stream`; the sessions are those of `max_batch_size`, whatever the policy). `between_sessions` is
        called before every session but the first (barrier and tree); what it raises ends the rollout. Each
        conversation's `Lineage` is set as it is created: group (global id // group_size), tree (global id //
        the leaves of a tree with `rollout.trees`, else the global id; a fork takes its parent's) and key.
        With a plan, returns [] (`partial.settle` takes the complete groups from `convs`)."""
        self.first_sequence = first_sequence
        for seq, carried in self._carried.items():
            if carried.end_reason is not None:  # finished, waiting for its group: never re-enters the engine
                self.convs[seq] = self._resumed_conversation(seq, carried)
                self._ended(seq)
        size = self.session_size
        sessions = [(first, *session_stream(rng, first_sequence + first, self.config.max_batch_size))
                    for first in range(0, len(self.examples), size)]
        try:
            if policy == "continuous":
                await self._continuous(sessions)
            else:
                await self._sessions(policy, sessions, between_sessions)
        finally:
            self.searches.cancel()
        self.agent_steps.warn_truncations(self._truncations)
        if self.agent_steps.stopping() or self.plan is not None:
            return []
        return self.agent_steps.trajectories(self.examples, [self.convs[i] for i in range(len(self.examples))])

    @property
    def session_size(self) -> int:
        """Conversations of a session (and the engine's sequence slots): rollout.max_batch_size, else all of the
        rollout's."""
        return self.config.max_batch_size or len(self.examples)

    # Policies.

    async def _sessions(self, policy: str, sessions, between_sessions) -> None:
        size = self.session_size
        for first, rng, row in sessions:
            if first and between_sessions is not None:
                between_sessions()
            if self.agent_steps.stopping() or self._cut():
                return
            seqs = list(range(first, min(first + size, len(self.examples))))
            if policy == "tree":
                await self._trees(seqs, rng, row)
                continue
            for seq, key in zip(seqs, sequence_keys(rng, [row + seq - first for seq in seqs])):
                if self.agent_steps.stopping():  # between admissions: a prompt may take seconds to fit
                    return
                self._admit(seq, key)
            await self._barrier_turns(release=True)

    async def _continuous(self, sessions) -> None:
        size = self.session_size
        keys = np.concatenate([sequence_keys(rng, range(row, row + min(size, len(self.examples) - first)))
                               for first, rng, row in sessions])
        queue = deque(range(len(self.examples)))
        while not self.agent_steps.stopping():
            self._searched(self.searches.collect())
            self._apply_ready(release=True)
            if self._cut():
                return
            while queue and self.engine.can_admit(self._context_tokens(queue[0])):
                seq = queue.popleft()
                self._admit(seq, keys[seq])
            if self.engine.running:
                await self._step()
            elif self.searches.busy:
                self._searched(await self.searches.wait())
            elif not self._ready and not queue:
                return

    async def _trees(self, seqs: list[int], rng: jax.Array, row: int) -> None:
        """One session's trees: seqs are whole groups; leaf positions as `tree` lays them out (local position p is
        sequence seqs[0] + p and samples from fold_in(rng, row + p))."""
        config = self.config
        groups = tree_lib.whole_groups([self.examples[s] for s in seqs], config.tree_group, seqs[0])
        chains, forks = tree_lib.positions(config, groups)
        first = seqs[0]
        leaves = []
        for t, (p, key) in enumerate(zip(chains, sequence_keys(rng, row + chains))):
            self._admit(first + int(p), key)
            leaves.append(tree_lib.Leaf(first + int(p), t, self.convs[first + int(p)]))
        await self._barrier_turns(release=False)
        key_data = jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng
        seed = [int(x) for x in np.asarray(key_data).ravel()]
        for round_index in range(config.tree_rounds):
            if self.agent_steps.stopping():
                return
            for leaf in leaves:
                leaf.nodes += [(leaf.position, turn) for turn in range(len(leaf.nodes), len(leaf.conv.turns))]
            local = forks[round_index]
            leaves += self._fork_round(leaves, groups, first + local, sequence_keys(rng, row + local),
                                       [seed + [row + int(c), round_index] for c in chains])
            await self._barrier_turns(release=False)
        for leaf in leaves:
            if leaf.position in self._in_engine:
                self.engine.finish(leaf.position)
                self._in_engine.discard(leaf.position)

    def _fork_round(self, leaves, groups: int, positions: np.ndarray, keys: np.ndarray, seeds: list[list[int]]
                    ) -> list:
        """Forks each tree's chosen nodes (tree t's choice drawn from a generator seeded by seeds[t]); the forks
        are sequences `positions` with PRNG keys `keys`, in order. Returns their leaves."""
        config, new_leaves = self.config, []
        by_tree: dict[int, list] = {}
        for leaf in leaves:
            by_tree.setdefault(leaf.tree, []).append(leaf)
        for tree in range(groups * config.trees):
            in_tree = by_tree[tree]
            holder = {node: leaf for leaf in in_tree for node in leaf.nodes}
            for node in tree_lib.choose_nodes(in_tree, config, np.random.default_rng(seeds[tree])):
                parent, turn = holder[node], node[1]
                position, key = int(positions[len(new_leaves)]), keys[len(new_leaves)]
                lineage = dataclasses.replace(parent.conv.lineage, key_data=_key_tuple(key))
                conv = tree_lib.fork_conversation(parent.conv, turn, lineage)
                self.agent_steps.stats.forked_prefix_tokens += conv.response_len
                self.convs[position] = conv
                new_leaves.append(tree_lib.Leaf(position, tree, conv, parent.nodes[:turn + 1]))
                budget = self.agent_steps.budget(conv)
                if budget:
                    self.engine.fork(position, parent.position, turn, key, budget)
                    self._in_engine.add(position)
                else:
                    conv.end_reason = self.agent_steps.full_reason(conv)
        return new_leaves

    # The steps every policy shares.

    async def _barrier_turns(self, release: bool) -> None:
        """Turns of every conversation in the engine until all have ended: each turn waits for all."""
        while not self.agent_steps.stopping():
            while self.engine.running and not self.agent_steps.stopping():
                await self._step()
            while self.searches.busy:
                self._searched(await self.searches.wait())
            if not self._ready:
                return
            self._apply_ready(release)
            if self._cut():
                return

    def lineage(self, seq: int, key_data: np.ndarray) -> Lineage:
        """The lineage of a conversation of examples[seq] (not a fork) sampling with `key_data`."""
        global_id = self.first_sequence + seq
        tree = global_id // self.config.leaves_per_tree if self.config.trees else global_id
        return Lineage(global_id // self.group_size, tree, _key_tuple(key_data))

    def _admit(self, seq: int, key_data: np.ndarray) -> None:
        """Starts examples[seq] sampling with `key_data`, or resumes its carried conversation (its own key)."""
        if seq in self.convs:  # a carried conversation that had finished
            return
        carried = self._carried.get(seq)
        if carried is None:
            conv = self.agent_steps.conversation(self.examples[seq], self.lineage(seq, key_data))
        else:
            conv = self._resumed_conversation(seq, carried)
        self.convs[seq] = conv
        budget = self.agent_steps.budget(conv)
        if not budget:
            conv.end_reason = self.agent_steps.full_reason(conv)
            self._ended(seq)
        elif carried is None:
            self.engine.add_request(seq, conv.prompt_ids, key_data, budget)
            self._in_engine.add(seq)
        else:  # its tokens re-encoded under this rollout's params; its PRNG stream goes on
            self.engine.add_request(seq, carried.context_ids, np.asarray(carried.key_data, np.uint32), budget,
                                    sampled=carried.sampled)
            self._in_engine.add(seq)

    def _context_tokens(self, seq: int) -> int:
        """Tokens examples[seq] brings to the engine when admitted: its carried context, or its prompt (0: a carried
        conversation that had finished, which never enters)."""
        if seq in self.convs:
            return 0
        carried = self._carried.get(seq)
        return len(carried.context_ids) if carried is not None else self.agent_steps.prompt_len(self.examples[seq])

    def _resumed_conversation(self, seq: int, carried: CarriedConversation) -> Conversation:
        """The driver's record of a carried conversation at position seq."""
        return Conversation(list(carried.prompt_ids), self.lineage(seq, np.asarray(carried.key_data, np.uint32)),
                            list(carried.turns), carried.response_len, carried.end_reason)

    def _ended(self, seq: int) -> None:
        """Counts seq's conversation as ended (for the cut: a group is complete once all its samples ended)."""
        group = seq // self.group_size
        self._ended_in_group[group] = self._ended_in_group.get(group, 0) + 1
        self._complete_groups += self._ended_in_group[group] == self.group_size

    def _cut(self) -> bool:
        """Whether a partial step's rollout has the complete groups it needs."""
        return self.plan is not None and self._complete_groups >= self.plan.prompts

    async def _step(self) -> None:
        loop = asyncio.get_running_loop()
        ended = await loop.run_in_executor(self.decode_thread, self.engine.step)
        for seq, sample in ended:
            self._close(seq, sample)
        self._searched(self.searches.collect())

    def _searched(self, results: dict[int, tuple[str, Optional[str]]]) -> None:
        for seq, (observation, error) in results.items():
            self._ready[seq] = (self._searching.pop(seq), observation, error)

    def _close(self, seq: int, sample: SampledTurn) -> None:
        conv = self.convs[seq]
        self.agent_steps.stats.sampled_tokens += len(sample.token_ids)
        self.agent_steps.stats.turn_spread.add(len(sample.token_ids))
        last = len(conv.turns) >= self.config.max_turns
        turn, searches, observation = self.agent_steps.close_turn(conv, sample, last)
        turn = dataclasses.replace(turn, version=self.version)
        if searches:
            self._searching[seq] = turn
            self.searches.submit(seq, turn.action.content)
        else:
            self._ready[seq] = (turn, observation, None)

    def _apply_ready(self, release: bool) -> None:
        """Appends the closed turns whose observation is known, then extends their conversations or ends them
        (`release`: an ended conversation leaves the engine; else it stays for forks)."""
        for seq, (turn, observation, error) in sorted(self._ready.items()):
            conv = self.convs[seq]
            ids, truncated = self.agent_steps.append_turn(conv, turn, observation, error)
            self._truncations += truncated
            edited = self.agent_steps.edited_context(conv) if ids is not None else None
            budget = self.agent_steps.budget(conv) if ids is not None else 0
            if ids is not None and not budget:
                conv.end_reason = self.agent_steps.full_reason(conv)
            if conv.end_reason is None and edited is not None:
                self._readmit(seq, conv, edited, budget)
                continue
            if conv.end_reason is None:
                self.engine.extend(seq, len(turn.token_ids), ids, budget)
                continue
            self._ended(seq)
            if release:
                self.engine.finish(seq)
                self._in_engine.discard(seq)
        self._ready.clear()

    def _readmit(self, seq: int, conv: Conversation, context_ids: list[int], budget: int) -> None:
        """A new segment (`rollout.context`): seq leaves the engine and comes back with its edited context as its
        prompt, every token of it encoded again (counted in the stats); its PRNG stream goes on after the tokens it
        sampled."""
        self.agent_steps.stats.context_edits += 1
        self.agent_steps.stats.context_reencoded_tokens += len(context_ids)
        self.engine.finish(seq)
        self.engine.add_request(seq, context_ids, np.asarray(conv.lineage.key_data, np.uint32), budget,
                                sampled=conv.sampled)


def _key_tuple(key_data: np.ndarray) -> tuple[int, int]:
    """A sequence's key data (uint32 [2]) as two ints."""
    first, second = (int(x) for x in np.asarray(key_data, np.uint32).reshape(2))
    return first, second
