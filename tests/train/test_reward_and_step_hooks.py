"""The trainer runs its rewards and its per-step hooks from lists (issue 57): a new reward or diagnostic is one
function passed to `Trainer`, here defined in this file."""
import json
import types

import numpy as np
import pytest

from llds_jax.data.qa import QAExample
from llds_jax.rl.advantages import GRPO_EPS
from llds_jax.train import trainer as trainer_lib
from llds_jax.train.rewards import DEFAULT_REWARD_FNS, exact_match, summed_rewards
from llds_jax.train.step_hooks import DEFAULT_STEP_HOOKS
from tests.run_fixtures import tiny_config, tiny_trainer_config


def even_tokens(trajectories, reward_cfg):
    """A second reward: the share of a trajectory's sampled tokens whose id is even."""
    return np.asarray([np.mean(t.tokens[t.loss_mask == 1] % 2 == 0) for t in trajectories], np.float32)


def numpy_grpo(rewards_b, group_b):
    """Per group: (r - mean) / (unbiased std + eps)."""
    out = np.zeros(len(rewards_b))
    for group in set(group_b.tolist()):
        r = rewards_b[group_b == group].astype(np.float64)
        out[group_b == group] = (r - r.mean()) / (r.std(ddof=1) + GRPO_EPS)
    return out


def answered(answer, gold):
    return types.SimpleNamespace(answer_text=f"<answer>{answer}</answer>",
                                 example=QAExample(uid="q", question="q?", golden_answers=(gold,), data_source="nq"))


def test_rewards_are_summed_and_each_ones_mean_is_named_when_there_are_several():
    trajectories = [answered("Paris", "Paris"), answered("Rome", "Paris"), answered("Oslo", "Oslo")]
    cfg = tiny_config().reward

    def answer_chars(trajectories, reward_cfg):
        return np.asarray([len(t.answer_text) for t in trajectories], np.float32)

    em_b, means = summed_rewards(DEFAULT_REWARD_FNS, trajectories, cfg)
    np.testing.assert_array_equal(em_b, [1.0, 0.0, 1.0])
    assert em_b.dtype == np.float32 and means == {}  # one reward: reward/mean is its mean, no second name
    total_b, means = summed_rewards((exact_match, answer_chars), trajectories, cfg)
    np.testing.assert_array_equal(total_b, [1.0 + 22, 0.0 + 21, 1.0 + 21])
    assert means == pytest.approx({"exact_match": 2 / 3, "answer_chars": 64 / 3})
    with pytest.raises(ValueError, match="distinct names"):
        summed_rewards((exact_match, exact_match), trajectories, cfg)

    def one_value(trajectories, reward_cfg):
        return np.ones(1)

    with pytest.raises(ValueError, match=r"reward 'one_value' gave shape \(1,\) for 3 trajectories"):
        summed_rewards((one_value,), trajectories, cfg)


@pytest.mark.slow
def test_an_added_reward_moves_the_advantages_and_an_added_hook_sees_every_steps_metrics(tiny_assets, tmp_path,
                                                                                        monkeypatch):
    """Two steps of 2 prompts x 4 samples with exact match plus `even_tokens` and the default hooks plus one that
    records: each step's batch carries the summed rewards and their NumPy GRPO advantages; the hook runs after
    each step, after the default ones (the evaluation's metrics of step 2 are there), with the metrics the log
    holds."""
    cfg = tiny_trainer_config(tiny_assets, str(tmp_path / "run"))
    seen = []

    def record(done):
        seen.append((done.step, dict(done.metrics), done.trajectories))

    trainer = trainer_lib.Trainer(cfg, reward_fns=(exact_match, even_tokens),
                                  step_hooks=(*DEFAULT_STEP_HOOKS, record))
    batches = []
    train_on_batch = trainer.rl_train_step.train_on_batch

    def recording_train_on_batch(state, ref_params, batch, **kwargs):
        batches.append(batch)
        return train_on_batch(state, ref_params, batch, **kwargs)

    monkeypatch.setattr(trainer.rl_train_step, "train_on_batch", recording_train_on_batch)
    try:
        assert trainer.run() == 2
    finally:
        trainer.close()

    assert [step for step, _, _ in seen] == [1, 2]
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
        logged = [record for record in map(json.loads, f) if record["step"] > 0]  # (step 0: the start's eval)
    for (step, metrics, trajectories), batch, record_ in zip(seen, batches, logged):
        em_b = exact_match(trajectories, cfg.reward)
        np.testing.assert_allclose(batch.rewards_b, em_b + even_tokens(trajectories, cfg.reward), rtol=1e-6)
        assert any(np.ptp(batch.rewards_b[batch.group_b == g]) > 0 for g in set(batch.group_b.tolist()))
        np.testing.assert_allclose(batch.advantages_b, numpy_grpo(batch.rewards_b, batch.group_b), atol=1e-4)
        assert metrics["reward/exact_match"] == pytest.approx(float(em_b.mean()))
        assert metrics["reward/even_tokens"] == pytest.approx(float(even_tokens(trajectories, cfg.reward).mean()))
        assert metrics["reward/mean"] == pytest.approx(metrics["reward/exact_match"] + metrics["reward/even_tokens"])
        assert record_["step"] == step and record_["reward/even_tokens"] == pytest.approx(metrics["reward/even_tokens"])
    assert "eval/em_mean" in seen[1][1] and "eval/em_mean" not in seen[0][1]
