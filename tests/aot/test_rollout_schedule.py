"""The paged engine's step calls at given lengths (llds_jax.aot.rollout_schedule): the scripted conversations keep the
lengths' means, and the calls of small rollouts equal those worked out by hand from the engine's rules."""
import dataclasses
import math

import numpy as np
import pytest

from llds_jax import config as config_lib
from llds_jax.aot import rollout_schedule, step_lengths
from llds_jax.rollout.engine import EngineConfig
from llds_jax.rollout.paged_sampler import token_budgets
from tests.configs import load


def engine(slots, max_context=64, page_size=8):
    return EngineConfig(max_seqs=slots, token_budgets=token_budgets(slots, 64), decode_chunk=4, page_size=page_size,
                        num_pages=slots * max_context // page_size + 1, max_context=max_context)


def lengths(prompt, turns, sampled, observation, prompt_std=0.0, turns_std=0.0, turn_std=0.0, observation_std=0.0,
            searches=0.0):
    """Per trajectory: `prompt` tokens, `turns` turns sampling `sampled` tokens in all, observations of
    `observation`, `searches` searches; the spreads (standard deviations) of each."""
    return step_lengths.Lengths(prompt, turns, sampled, observation, 0.0, searches, prompt_std, turns_std, turn_std,
                                observation_std, 0.0, "given")


def scripts(sequences, group, at, max_turns=4, max_turn_tokens=1000, max_context=10_000):
    return rollout_schedule.scripts(sequences, group, at, max_turns, max_turn_tokens, 1000, 1000, max_context)


def test_scripts_keep_the_mean_lengths_and_share_a_groups_prompt():
    convs = scripts(40, 4, lengths(100.4, 2.5, 100.0, 30.0, turn_std=40 * 0.5 / math.sqrt(3)), max_turn_tokens=60)
    assert sum(len(c.turn_tokens) for c in convs) == 100  # 2.5 turns each
    assert {len(c.turn_tokens) for c in convs} == {2, 3}
    per_turn = [t for c in convs for t in c.turn_tokens]
    assert sum(per_turn) == 4000  # 100 tokens over 2.5 turns
    assert min(per_turn) >= 20 and max(per_turn) <= 60  # half to one and a half times the mean
    assert all(len(c.observation_tokens) == len(c.turn_tokens) - 1 and set(c.observation_tokens) == {30}
               for c in convs)
    prompts = [len(c.prompt) for c in convs[::4]]
    assert len({c.prompt for c in convs}) == 10 and sum(prompts) == 1004 and set(prompts) == {100, 101}
    assert convs[0].prompt == convs[3].prompt != convs[4].prompt
    capped = scripts(8, 1, lengths(10, 1.0, 16.0, 5, turn_std=10.0), max_turn_tokens=16)  # the cap keeps the mean
    assert [c.turn_tokens for c in capped] == [(16,)] * 8


def test_scripts_spread_each_length_as_logged():
    """Each length spread evenly about its mean at the logged standard deviation (a uniform's: mean +- sqrt(3) std);
    the most turns to the shortest prompts, and no more than the context holds."""
    at = lengths(150.0, 2.0, 40.0, 50.0, prompt_std=20 / math.sqrt(3), turns_std=0.6, turn_std=5.0,
                 observation_std=10.0)
    convs = scripts(60, 3, at)
    prompts = [len(c.prompt) for c in convs[::3]]
    assert np.mean(prompts) == 150 and np.std(prompts) == pytest.approx(20 / math.sqrt(3), rel=0.1)
    assert min(prompts) >= 130 and max(prompts) <= 170
    turns = [len(c.turn_tokens) for c in convs]
    assert np.mean(turns) == 2 and np.std(turns) == pytest.approx(0.6, rel=0.2) and set(turns) == {1, 2, 3}
    by_prompt = sorted(zip((len(c.prompt) for c in convs), turns))
    assert np.mean([k for _, k in by_prompt[:20]]) > 2 > np.mean([k for _, k in by_prompt[-20:]])
    sampled = [t for c in convs for t in c.turn_tokens]
    assert np.mean(sampled) == 20 and np.std(sampled) == pytest.approx(5.0, rel=0.1)
    observations = [o for c in convs for o in c.observation_tokens]
    assert np.mean(observations) == pytest.approx(50, abs=0.02) and np.std(observations) == pytest.approx(10, rel=0.1)
    # A 260-token context holds two turns (20 tokens each) and an observation (50) after the shortest prompt (130).
    assert max(len(c.turn_tokens) for c in scripts(60, 3, at, max_context=260)) == 2


def test_a_barrier_session_calls_as_worked_out_by_hand():
    """4 sequences in groups of 2 with 10-token prompts, one turn of 8 tokens each, 4 samples per call. Call 1: the
    two groups' first samples encode their prompts (20 tokens, bucket 32) and sample 4; call 2: the second samples
    take the first's pages and encode only the last prompt token, the first samples feed their last token (4
    tokens, bucket 4), all sample 4 (the first ones are done); call 3: the second samples' last tokens (2)."""
    convs = scripts(4, 2, lengths(10, 1.0, 8.0, 1))
    s = rollout_schedule.run(engine(4), convs, "barrier")
    assert s.calls_per_bucket == {32: 1, 4: 2} and s.tokens_per_bucket == {32: 20, 4: 6}
    assert [(c.bucket, c.tokens, c.iterations) for c in s.calls] == [(32, 20, 3), (4, 4, 3), (4, 2, 3)]
    # Pages read by the ragged forward: call 1 two 10-token sequences (2 pages each); call 2 four sequences of 11
    # and 14 tokens (2 pages each).
    assert [c.pages_read for c in s.calls[:2]] == [4, 8]
    assert (s.rows_in_flight, s.search_waits) == (4, 0)
    # Per sequence of each call (for the kernel-faithful estimate): call 1 the two prompts, 4 samples each; call 2
    # one token each, all sampling 4, call 3 the second samples' last tokens; every call's counts follow from them.
    assert (s.calls[0].q_lens, s.calls[0].kv_lens, s.calls[0].samples) == ((10, 10), (10, 10), (4, 4))
    assert (s.calls[1].q_lens, s.calls[1].samples) == ((1, 1, 1, 1), (4, 4, 4, 4))
    assert s.calls[2].q_lens == (1, 1)
    for c in s.calls:
        kv = np.asarray(c.kv_lens)
        assert (sum(c.q_lens), int(np.sum(-(-kv // 8))), max(c.samples) - 1) == (c.tokens, c.pages_read,
                                                                                  c.iterations)
        assert c.iteration_pages_read == sum(int(np.sum(-(-(kv + i) // 8) * (np.asarray(c.samples) > i)))
                                             for i in range(1, c.iterations + 1))


def test_a_continuous_stream_admits_as_slots_free_as_worked_out_by_hand():
    """The same 4 conversations through 2 slots (the pool holds 2 sequences' worst case). Call 1: sequence 0's
    prompt (10 tokens, bucket 16); call 2: sequence 1 shares it, 1 token each (bucket 2), 0 ends; sequence 2 enters:
    call 3: 1's token and 2's prompt (11, bucket 16), 1 ends; 3 enters sharing 2's prompt: call 4 (2 tokens),
    call 5 (3's last token)."""
    convs = scripts(4, 2, lengths(10, 1.0, 8.0, 1))
    s = rollout_schedule.run(engine(2), convs, "continuous", overlap=False)
    assert [(c.bucket, c.tokens) for c in s.calls] == [(16, 10), (2, 2), (16, 11), (2, 2), (2, 1)]
    assert s.rows_in_flight == 2


def test_observations_follow_each_turn_and_a_barrier_waits_for_each_rounds_searches():
    """Two turns of 4 tokens with a 20-token observation between: after the first round the observations are
    written, 20 tokens each (the turn's last sampled token, its stop id, is not kept); one turn round ended with
    searches; without searches (invalid actions) none waits."""
    convs = scripts(2, 1, lengths(5, 2.0, 8.0, 20, searches=1.0))
    s = rollout_schedule.run(engine(2), convs, "barrier")
    assert sum(s.tokens_per_bucket.values()) == 2 * 5 + 2 * 20
    assert s.search_waits == 1
    assert rollout_schedule.run(engine(2), scripts(2, 1, lengths(5, 2.0, 8.0, 20)), "barrier").search_waits == 0
    with pytest.raises(ValueError, match="policy 'tree' is not modelled"):
        rollout_schedule.run(engine(2), convs, "tree")


def test_searches_are_spread_over_the_observations_and_only_theirs_wait_under_continuous():
    """Searches per trajectory set how many observations answer a search (at most all); worked out by hand, 2 slots:
    sequence 0 takes two 4-token turns with a 5-token observation between, sequence 1 one turn of 12 tokens (3 calls
    of 4 samples). Call 1: both prompts (20 tokens); sequence 0's turn ends. An invalid action's observation is
    written in call 2 beside sequence 1's token (6 tokens), then sequence 1's last token (1); a search's waits a
    call: sequence 1's token alone (1), then both (6)."""
    convs = scripts(4, 1, lengths(10, 3.0, 12.0, 5, searches=1.0))
    assert sum(sum(c.searches) for c in convs) == 4 and all(len(c.searches) == 2 for c in convs)
    assert sum(sum(c.searches) for c in scripts(4, 1, lengths(10, 3.0, 12.0, 5, searches=9.0))) == 8
    assert not any(any(c.searches) for c in scripts(4, 1, lengths(10, 3.0, 12.0, 5)))
    calls = {}
    for search in (False, True):
        convs = [rollout_schedule.Conversation((2,) * 10, (4, 4), (5,), (True, True), (search,)),
                 rollout_schedule.Conversation((3,) * 10, (12,), (), (True,), ())]
        calls[search] = [(c.bucket, c.tokens) for c in rollout_schedule.run(engine(2), convs, "continuous", overlap=False).calls]
    assert calls == {False: [(32, 20), (8, 6), (2, 1)], True: [(32, 20), (2, 1), (8, 6)]}


def test_overlapping_calls_as_worked_out_by_hand():
    """The engine as it runs on a device dispatches call n + 1 before it absorbs call n (`overlap`, the default): a
    sequence whose turn reaches its budget in n has no row in n + 1, and a turn's end is known, its observation
    appended and a freed slot taken, only once n + 1 is on its way. The stream of 4 conversations through 2 slots
    (the first test's, one call at a time 5 calls): call 1 sequence 0's prompt (10 tokens); call 2 sequence 0's
    token and sequence 1's (sharing the prompt); call 3 sequence 1's alone (0 reaches its 8-token budget in call 2);
    call 2 absorbed, 0 ends and 2 enters: call 4 its prompt (10; 1 at its budget); call 5 2's token and 3's
    (sharing 2's prompt); call 6 3's alone: 6 calls. The search test's two conversations, the search answered a call
    later: call 1 both prompts (20), sequence 0's 4-token turn ends there, known as call 2 (sequence 1's token)
    leaves, so call 2 closes the search; call 3 sequence 1's last token; call 4 the observation (5); sequence 0's
    last turn ends on its stop id in call 4, below its 12-token budget (rollout.max_turn_tokens: the longest turn's),
    so call 5 holds its dropped row: 5 calls."""
    s = rollout_schedule.run(engine(2), scripts(4, 2, lengths(10, 1.0, 8.0, 1)), "continuous")
    assert [(c.bucket, c.tokens) for c in s.calls] == [(16, 10), (2, 2), (2, 1), (16, 10), (2, 2), (2, 1)]
    convs = [rollout_schedule.Conversation((2,) * 10, (4, 4), (5,), (True, True), (True,)),
             rollout_schedule.Conversation((3,) * 10, (12,), (), (True,), ())]
    calls = rollout_schedule.run(engine(2), convs, "continuous").calls
    assert [(c.bucket, c.tokens, c.searches) for c in calls] == [(32, 20, 0), (2, 1, 1), (2, 1, 0), (8, 5, 0),
                                                                   (2, 0, 0)]


def test_each_call_records_the_sequences_in_flight_and_the_searches_it_closed():
    """The calls of the last test (continuous): with a search, call 1 closes sequence 0's searching turn (one query);
    without, none. Both hold 2 sequences until sequence 0 ends in call 2 (no search: its observation comes at once,
    its last turn ends there), so call 3 holds 1. Barrier (two 4-token turns, a search after each first one): call 1
    closes both first turns, 2 queries; call 2 the last turns, none."""
    for search, expect in ((False, [(2, 0), (2, 0), (1, 0)]), (True, [(2, 1), (2, 0), (2, 0)])):
        convs = [rollout_schedule.Conversation((2,) * 10, (4, 4), (5,), (True, True), (search,)),
                 rollout_schedule.Conversation((3,) * 10, (12,), (), (True,), ())]
        assert [(c.in_flight, c.searches) for c in rollout_schedule.run(engine(2), convs, "continuous", overlap=False).calls] == expect
    barrier = rollout_schedule.run(engine(2), scripts(2, 1, lengths(5, 2.0, 8.0, 20, searches=1.0)), "barrier",
                                   overlap=False)
    assert [(c.in_flight, c.searches) for c in barrier.calls] == [(2, 2), (2, 0)]


def test_a_turn_at_the_cap_ends_at_its_budget_and_keeps_its_last_token():
    """A turn of rollout.max_turn_tokens has no stop id: all its tokens are kept, so its last sampled token (not yet
    written) is written with the observation: one more input token than a stopped turn's."""
    capped = scripts(1, 1, lengths(10, 2.0, 16.0, 20), max_turn_tokens=8)
    stopped = scripts(1, 1, lengths(10, 2.0, 16.0, 20), max_turn_tokens=9)
    assert capped[0].stops == (False, False) and stopped[0].stops == (True, True)
    tokens = [sum(rollout_schedule.run(engine(1), c, "barrier").tokens_per_bucket.values()) for c in (capped, stopped)]
    assert tokens == [10 + 1 + 20 + 1 + 1, 10 + 1 + 20 + 1]


def test_a_runs_schedule_takes_its_engine_shapes_and_policy():
    """configs/qwen7b_v4.py at 32 slots: buckets 32 to 4096 tokens, continuous; every bucket's calls within its
    tokens."""
    cfg = load("qwen7b_v4")
    cfg.data.prompts_per_step, cfg.rollout.max_batch_size = 16, 32  # 80 trajectories, 32 slots
    cfg.optim.mini_batch_size = 80  # one update of the 80
    run = config_lib.typed(cfg)
    s = rollout_schedule.for_run(run, step_lengths.defaults(run), 80)
    assert s.policy == "continuous" and s.rows_in_flight == 32
    assert set(s.calls_per_bucket) <= {32, 64, 128, 256, 512, 1024, 2048, 4096}
    assert all(s.tokens_per_bucket[b] <= b * n for b, n in s.calls_per_bucket.items())
    # The wider the turns' spread, the more sample slots wait for a call's longest sequence.
    even, wide = (rollout_schedule.for_run(run, dataclasses.replace(step_lengths.defaults(run), turn_tokens_std=std),
                                           80).occupancy for std in (0.0, 80.0))
    assert even > wide
    # One tree of 1 + 4 leaves per prompt (the group of 5), sessions of whole trees.
    trees = run.replaced(rollout=dataclasses.replace(run.rollout, trees=1, tree_forks=4, continuous_batching=False,
                                                     max_batch_size=30))
    with pytest.raises(ValueError, match="rollout.trees"):
        rollout_schedule.for_run(trees, step_lengths.defaults(trees), 80)


@pytest.mark.parametrize("policy", rollout_schedule.POLICIES)
def test_partial_rollouts_at_over_sampling_1_are_the_synchronous_schedule(policy):
    """Over-sampling 1 starts the step's P groups and cuts once all are complete: every step is the synchronous
    rollout, call for call (barrier in sessions of 4 slots, continuous through 4 slots), nothing carried."""
    batch = scripts(24, 3, lengths(12, 2.5, 30.0, 9, prompt_std=2.0, turns_std=0.8, turn_std=6.0), max_context=64)
    synchronous = rollout_schedule.run(engine(4), batch, policy)
    steps = rollout_schedule.partial_run(engine(4), batch, 3, policy, 1.0, steps=2)
    assert [step.schedule.calls for step in steps] == [synchronous.calls] * 2
    assert [(s.started, s.trained, s.resumed, s.carried, s.carried_groups, s.dropped) for s in steps] == [
        (8, 8, 0, 0, 0, 0)] * 2


def partial_batch():
    """P = 2 groups of 2 samples with 10-token prompts: group A's samples each one turn of 8 tokens; group B's
    first sample a turn of 4, a 5-token observation, a turn of 12, its second one turn of 4."""
    a = rollout_schedule.Conversation((2,) * 10, (8,), (), (True,), ())
    b0 = rollout_schedule.Conversation((3,) * 10, (4, 12), (5,), (True, True), (False,))
    b1 = rollout_schedule.Conversation((3,) * 10, (4,), (), (True,), ())
    return [a, a, b0, b1]


def test_partial_rollouts_cut_once_P_groups_are_complete_as_worked_out_by_hand():
    """Over-sampling 2 (continuous, 8 slots, 4 samples per call): step 0 starts A, B, A', B' (8 conversations).
    Call 1: the four first samples' prompts (40 tokens); B0 and B'0 end their first turn. Call 2: A0 and A'0's
    last tokens, the shared prompts' last tokens (4), B0 and B'0's observations (5 each): 16 tokens; A0, A'0, B1,
    B'1 end. Call 3 (4 tokens): A1 and A'1 end, so A and A' are complete: the cut. B0 and B'0 are carried at their
    complete turn (their second turn's 8 tokens sampled so far are drawn again). Step 1 resumes them first: their
    contexts (10 + 3 kept + 5 = 18 tokens each, the 36 re-prefill tokens) with the fresh A and B's first prompts in
    call 1 (56 tokens); each samples the 12 tokens not sampled before (3 calls of 4), and the carried B, B' complete
    at call 3 (as does the fresh A, carried complete to the next step, with the fresh B's first sample). Carried, as
    the run counts them (`partial/carried`): the started conversations of the groups carried, 4 each step."""
    steps = rollout_schedule.partial_run(engine(8), partial_batch(), 2, "continuous", 2.0, steps=2, overlap=False)
    assert [(c.bucket, c.tokens) for c in steps[0].schedule.calls] == [(64, 40), (16, 16), (8, 4)]
    assert [(c.bucket, c.tokens) for c in steps[1].schedule.calls] == [(64, 56), (16, 10), (8, 4)]
    assert rollout_schedule.context_tokens(partial_batch()[2], 1) == 18
    assert [(s.started, s.trained, s.resumed, s.reprefill_tokens, s.carried, s.carried_groups) for s in steps] == [
        (4, 2, 0, 0, 4, 2), (4, 2, 2, 36, 4, 2)]
    assert steps[0].schedule.sequences == 4  # the trajectories trained
    # Barrier: the cut after the turn round in which A and A' complete (every turn ended, the observations written;
    # the round's last turns end on stop ids below their 12-token budget: a last call of their dropped rows).
    barrier = rollout_schedule.partial_run(engine(8), partial_batch(), 2, "barrier", 2.0, steps=2)
    assert [(c.bucket, c.tokens) for c in barrier[0].schedule.calls] == [(64, 40), (8, 6), (8, 2), (8, 0)]
    assert (barrier[1].resumed, barrier[1].reprefill_tokens, barrier[1].schedule.calls[0].tokens) == (2, 36, 56)


def test_a_carried_group_older_than_max_staleness_is_dropped():
    """B and B' carry a turn sampled at step 0: at max_staleness 0 step 1 drops them (their 4 started
    conversations, as the run counts them: `partial/dropped`), starts four fresh groups and runs as step 0 did; at 1
    they are resumed."""
    stale = rollout_schedule.partial_run(engine(8), partial_batch(), 2, "continuous", 2.0, max_staleness=0, steps=2)
    assert [(s.dropped, s.resumed) for s in stale] == [(0, 0), (4, 0)]
    assert stale[1].schedule.calls == stale[0].schedule.calls
    assert rollout_schedule.partial_run(engine(8), partial_batch(), 2, "continuous", 2.0, steps=2)[1].dropped == 0
    with pytest.raises(ValueError, match="over_sampling 0.5 is below 1"):
        rollout_schedule.partial_run(engine(8), partial_batch(), 2, "continuous", 0.5)
