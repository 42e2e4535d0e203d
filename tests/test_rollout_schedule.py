"""The paged engine's step calls at given lengths (llds_jax.rollout_schedule): the scripted conversations keep the
lengths' means, and the calls of small rollouts equal those worked out by hand from the engine's rules."""
import dataclasses

import pytest

from llds_jax import rollout_schedule, step_lengths
from llds_jax.rollout.engine import EngineConfig
from llds_jax.rollout.paged_sampler import token_budgets
from tests.configs import load


def engine(slots, max_context=64, page_size=8):
    return EngineConfig(max_seqs=slots, token_budgets=token_budgets(slots, 64), decode_chunk=4, page_size=page_size,
                        num_pages=slots * max_context // page_size + 1, max_context=max_context)


def test_scripts_keep_the_mean_lengths_and_share_a_groups_prompt():
    convs = rollout_schedule.scripts(40, 4, prompt_tokens=100.4, turns=2.5, sampled_tokens=100.0,
                                     observation_tokens=30.0, max_turn_tokens=60)
    assert sum(len(c.turn_tokens) for c in convs) == 100  # 2.5 turns each
    assert {len(c.turn_tokens) for c in convs} == {2, 3}
    per_turn = [t for c in convs for t in c.turn_tokens]
    assert sum(per_turn) / len(per_turn) == pytest.approx(40, rel=0.02)  # 100 tokens over 2.5 turns
    assert min(per_turn) >= 20 and max(per_turn) <= 60  # half to one and a half times the mean
    assert len({c.prompt for c in convs}) == 10 and all(len(c.prompt) == 100 for c in convs)
    assert convs[0].prompt == convs[3].prompt != convs[4].prompt
    capped = rollout_schedule.scripts(8, 1, 10, 1.0, 16.0, 5, max_turn_tokens=16)  # the cap keeps the mean
    assert [c.turn_tokens for c in capped] == [(16,)] * 8


def test_a_barrier_session_calls_as_worked_out_by_hand():
    """4 sequences in groups of 2 with 10-token prompts, one turn of 8 tokens each, 4 samples per call. Call 1: the
    two groups' first samples encode their prompts (20 tokens, bucket 32) and sample 4; call 2: the second samples
    take the first's pages and encode only the last prompt token, the first samples feed their last token (4
    tokens, bucket 4), all sample 4 (the first ones are done); call 3: the second samples' last tokens (2)."""
    convs = rollout_schedule.scripts(4, 2, 10, 1.0, 8.0, 1, max_turn_tokens=8, spread=0.0)
    s = rollout_schedule.run(engine(4), convs, "barrier")
    assert s.calls_per_bucket == {32: 1, 4: 2} and s.tokens_per_bucket == {32: 20, 4: 6}
    assert [(c.bucket, c.tokens, c.iterations) for c in s.calls] == [(32, 20, 3), (4, 4, 3), (4, 2, 3)]
    # Pages read by the ragged forward: call 1 two 10-token sequences (2 pages each); call 2 four sequences of 11
    # and 14 tokens (2 pages each).
    assert [c.pages_read for c in s.calls[:2]] == [4, 8]
    assert (s.rows_in_flight, s.search_waits) == (4, 0)


def test_a_continuous_stream_admits_as_slots_free_as_worked_out_by_hand():
    """The same 4 conversations through 2 slots (the pool holds 2 sequences' worst case). Call 1: sequence 0's
    prompt (10 tokens, bucket 16); call 2: sequence 1 shares it, 1 token each (bucket 2), 0 ends; sequence 2 enters:
    call 3: 1's token and 2's prompt (11, bucket 16), 1 ends; 3 enters sharing 2's prompt: call 4 (2 tokens),
    call 5 (3's last token)."""
    convs = rollout_schedule.scripts(4, 2, 10, 1.0, 8.0, 1, max_turn_tokens=8, spread=0.0)
    s = rollout_schedule.run(engine(2), convs, "continuous")
    assert [(c.bucket, c.tokens) for c in s.calls] == [(16, 10), (2, 2), (16, 11), (2, 2), (2, 1)]
    assert s.rows_in_flight == 2


def test_observations_follow_each_turn_and_a_barrier_waits_for_each_rounds_searches():
    """Two turns of 4 tokens with a 20-token observation between: after the first round the observations (and the
    turn's last sampled token) are written, 21 tokens each; one turn round ended with searches."""
    convs = rollout_schedule.scripts(2, 1, 5, 2.0, 8.0, 20, max_turn_tokens=4, spread=0.0)
    s = rollout_schedule.run(engine(2), convs, "barrier")
    assert sum(s.tokens_per_bucket.values()) == 2 * 5 + 2 * 21
    assert s.search_waits == 1
    with pytest.raises(ValueError, match="policy 'tree' is not modelled"):
        rollout_schedule.run(engine(2), convs, "tree")


def test_a_runs_schedule_takes_its_engine_shapes_and_policy():
    """configs/qwen7b_v4.py: 128 slots, buckets 128 to 1024 tokens, continuous; every bucket's calls within its
    tokens."""
    cfg = load("qwen7b_v4")
    cfg.data.prompts_per_step, cfg.rollout.max_batch_size = 16, 32  # 80 trajectories, 32 slots
    s = rollout_schedule.for_run(cfg, step_lengths.defaults(cfg), 80)
    assert s.policy == "continuous" and s.rows_in_flight == 32
    assert set(s.calls_per_bucket) <= {32, 64, 128, 256, 512, 1024}
    assert all(s.tokens_per_bucket[b] <= b * n for b, n in s.calls_per_bucket.items())
    # A logged occupancy between those of no spread and the widest: the spread found samples at it.
    even, wide = (rollout_schedule.for_run(cfg, step_lengths.defaults(cfg), 80, spread).occupancy for spread in (0, 1))
    assert even > wide
    logged = dataclasses.replace(step_lengths.defaults(cfg), decode_occupancy=(even + wide) / 2)
    assert rollout_schedule.for_run(cfg, logged, 80).occupancy == pytest.approx((even + wide) / 2, abs=0.02)
    cfg.rollout.trees = 1
    with pytest.raises(ValueError, match="rollout.trees"):
        rollout_schedule.for_run(cfg, step_lengths.defaults(cfg), 80)
