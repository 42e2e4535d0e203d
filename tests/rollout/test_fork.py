"""Forking rows of a session at agent-step boundaries (tree rollouts): a forked row continues from its parent's
cache, under greedy decoding exactly as re-encoding its prefix would, and samples afresh from its own key."""
import dataclasses

import jax
import numpy as np
import pytest

from llds_jax.rollout.sampler import Sampler
from llds_jax.rollout.shape_plan import ForkShape
from tests.rollout.test_sampler import CONFIG, check_logps, converse, prompts_of, tiny  # noqa: F401 (fixture)

GREEDY = dataclasses.replace(CONFIG, greedy=True)
OBS_LENS = [[3, 5, 2], [6, 1, 4]]  # per turn, per sequence


def observation(turn, i):
    return list(range(30 + 7 * turn + i, 30 + 7 * turn + i + OBS_LENS[turn][i]))


def run_parent(sampler, params, prompts, turns=3):
    """Three sequences, `turns` turns each (rolled back by 2 tokens, then an observation; the last turn ends them),
    in a session that keeps its rows. Returns the session and each sequence's tokens at the start of each turn."""
    session = sampler.start(params, prompts, jax.random.key(3), compact=False)
    seqs, _, _, sampled = converse(session, prompts, turns, lambda t: [6, 5, 7],
                                   lambda t, i, out: len(out.token_ids) - 2,
                                   lambda t, i: observation(t, i) if t < turns - 1 else None)
    prefixes = [[list(p)] for p in prompts]  # prefixes[i][k]: sequence i's tokens at the start of turn k
    for t in range(turns - 1):
        for i in range(len(prompts)):
            kept = sampled[t][i].token_ids[:len(sampled[t][i].token_ids) - 2]
            prefixes[i].append(prefixes[i][-1] + kept + observation(t, i))
    return session, prefixes


def one_turn(session, n, budget=6):
    return [turn.token_ids for turn in session.decode_turn([budget] * n, lambda toks: [False] * len(toks))]


def test_a_forked_row_samples_greedily_what_re_encoding_its_prefix_would(tiny):
    _, graphdef, params = tiny
    sampler = Sampler(graphdef, GREEDY)
    prompts = prompts_of([4, 9, 6], seed=5)
    parent, prefixes = run_parent(sampler, params, prompts)
    nodes = [(0, 1), (1, 2), (2, 0), (0, 2)]
    keys = sampler.keys_of(jax.random.key(9), np.arange(len(nodes)))
    child = parent.fork(nodes, keys)
    assert [len(s) for s in child.turn_starts] == [k for _, k in nodes]  # boundaries before the node, inherited
    forked = one_turn(child, len(nodes))
    fresh = sampler.start(params, [prefixes[s][k] for s, k in nodes], jax.random.key(0))
    assert forked == one_turn(fresh, len(nodes))
    assert all(len(tokens) == 6 for tokens in forked)
    assert ForkShape(4, parent.capacity, 4) in sampler.plan._run[ForkShape]


def test_a_fork_of_a_fork_with_carried_rows_is_still_its_prefix(tiny):
    """Two expansion rounds: the first carries the finished parents; the second forks a node the first fork
    inherited (boundary 1 of sequence 0, copied into the fork's row) and a carried parent's node."""
    _, graphdef, params = tiny
    sampler = Sampler(graphdef, GREEDY)
    prompts = prompts_of([4, 9, 6], seed=5)
    parent, prefixes = run_parent(sampler, params, prompts)
    child = parent.fork([(0, 2)], sampler.keys_of(jax.random.key(9), [0]), carry=True, compact=False)
    assert child.num_sequences == 4 and [len(s) for s in child.turn_starts] == [3, 3, 3, 2]
    turn = one_turn(child, 4, budget=0)  # nothing samples with budget 0
    child.decode_turn([0, 0, 0, 6], lambda toks: [False] * len(toks))
    child.end_turn([0, 0, 0, 0], [None] * 4)
    assert turn == [[]] * 4
    grandchild = child.fork([(3, 1), (1, 2)], sampler.keys_of(jax.random.key(9), [1, 2]))
    fresh = sampler.start(params, [prefixes[0][1], prefixes[1][2]], jax.random.key(0))
    assert one_turn(grandchild, 2) == one_turn(fresh, 2)


def test_forks_sample_afresh_from_their_own_keys_with_the_sampler_log_probs(tiny):
    model, graphdef, params = tiny
    sampler = Sampler(graphdef, CONFIG)
    prompts = prompts_of([5, 8, 3], seed=2)
    parent, prefixes = run_parent(sampler, params, prompts)
    nodes = [(1, 1)] * 3
    same = sampler.keys_of(jax.random.key(4), [7, 7, 8])
    turns = parent.fork(nodes, same).decode_turn([12] * 3, lambda toks: [False] * len(toks))
    assert turns[0].token_ids == turns[1].token_ids != turns[2].token_ids
    check_logps(model, [prefixes[1][1] + t.token_ids for t in turns],
                [[0] * len(prefixes[1][1]) + [1] * len(t.token_ids) for t in turns],
                [[0.0] * len(prefixes[1][1]) + t.logps for t in turns])


def test_fork_errors_name_the_problem(tiny):
    _, graphdef, params = tiny
    sampler = Sampler(graphdef, GREEDY)
    prompts = prompts_of([4, 9, 6], seed=5)
    parent, _ = run_parent(sampler, params, prompts)
    keys = sampler.keys_of(jax.random.key(9), [0])
    with pytest.raises(ValueError, match="sampled 3 turns; no turn 3"):
        parent.fork([(0, 3)], keys)
    compacting = sampler.start(params, prompts, jax.random.key(3))
    converse(compacting, prompts, 2, lambda t: [6, 5, 7], lambda t, i, out: len(out.token_ids),
             lambda t, i: None if (t, i) == (0, 1) else observation(t, i))
    with pytest.raises(ValueError, match="unfinished and cannot be carried"):
        compacting.fork([(0, 1)], keys, carry=True)
    with pytest.raises(ValueError, match="sequence 1 left the batch"):
        compacting.fork([(1, 0)], keys)


def test_a_frozen_sampler_forks_at_a_capacity_it_never_forked_at_without_compiling(tiny, backend_compiles):
    """Tree rollouts fork wherever the chains' session ended, a capacity that changes from step to step: the grid
    that `freeze_shapes` compiles holds the fork at every capacity run, and the fork samples what a fresh sampler's
    does."""
    _, graphdef, params = tiny
    prompts = prompts_of([4, 9, 6], seed=5)
    nodes = [(0, 1), (1, 2), (2, 0), (0, 2)]

    def first_step(sampler):  # shorter chains fork from a smaller cache; the forks grow it by a long turn
        parent, _ = run_parent(sampler, params, prompts, turns=2)
        child = parent.fork([(0, 1), (1, 0), (2, 1), (0, 0)], sampler.keys_of(jax.random.key(9), np.arange(4)))
        one_turn(child, 4, budget=40)
        return parent.capacity, child.capacity

    def later_step(sampler):
        parent, _ = run_parent(sampler, params, prompts)
        return parent.capacity, one_turn(parent.fork(nodes, sampler.keys_of(jax.random.key(9), np.arange(4))), 4)

    sampler = Sampler(graphdef, GREEDY)
    small, large = first_step(sampler)
    sampler.freeze_shapes()
    with backend_compiles() as compiles:
        capacity, forked = later_step(sampler)
    assert (small, capacity, large) == (32, 64, 64)  # forked at 32 slots, then at 64 (reached by the forks)
    assert compiles == []
    fresh = Sampler(graphdef, GREEDY)
    assert later_step(fresh) == (capacity, forked)
