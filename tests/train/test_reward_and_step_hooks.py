"""The trainer runs its rewards and its per-step hooks by name from the config (issues 57 and 68): a new reward or
diagnostic is one function registered by name (`REWARDS`, `STEP_HOOKS`), here in this file, and named in the run
config (`reward.functions`, `train.hooks`); a hook sees the run through its `StepContext`, not the trainer."""
import json
import types

import numpy as np
import pytest

from llds_jax.data.qa import QAExample
from llds_jax.rl.advantages import GRPO_EPS
from llds_jax.train import trainer as trainer_lib
from llds_jax.bounds import ConfigError
from llds_jax.config.sections import RunConfig
from llds_jax.train.rewards import REWARDS, exact_match, named_rewards, summed_rewards
from llds_jax.train.step_hooks import STEP_HOOKS, evaluate, step_hooks, write_metrics, write_transcripts
from tests.configs import launched
from tests.run_fixtures import tiny_trainer_config


@REWARDS.register("even_tokens")
def even_tokens(trajectories, reward_cfg):
    """A second reward: the share of a trajectory's sampled tokens whose id is even."""
    return np.asarray([np.mean(t.tokens[t.loss_mask == 1] % 2 == 0) for t in trajectories], np.float32)


SEEN = []  # what `record` saw, step after step


@STEP_HOOKS.register("record_for_the_test")
def record(done):
    """A named hook: records the step, its metrics (and adds one), trajectories and run context."""
    done.metrics["test/hook_step"] = float(done.step)
    SEEN.append((done.step, dict(done.metrics), done.trajectories, done.run))


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
    cfg = RunConfig.of().reward

    def answer_chars(trajectories, reward_cfg):
        return np.asarray([len(t.answer_text) for t in trajectories], np.float32)

    em_b, means = summed_rewards(named_rewards(RunConfig.of().reward.functions), trajectories, cfg)
    np.testing.assert_array_equal(em_b, [1.0, 0.0, 1.0])
    assert em_b.dtype == np.float32 and means == {}  # one reward: reward/mean is its mean, no second name
    total_b, means = summed_rewards({"exact_match": exact_match, "answer_chars": answer_chars}, trajectories, cfg)
    np.testing.assert_array_equal(total_b, [1.0 + 22, 0.0 + 21, 1.0 + 21])
    assert means == pytest.approx({"exact_match": 2 / 3, "answer_chars": 64 / 3})

    def one_value(trajectories, reward_cfg):
        return np.ones(1)

    with pytest.raises(ValueError, match=r"reward 'one_value' gave shape \(1,\) for 3 trajectories"):
        summed_rewards({"one_value": one_value}, trajectories, cfg)


def test_rewards_and_hooks_are_found_by_name_and_a_wrong_name_is_an_error_naming_its_key():
    assert named_rewards(("exact_match", "even_tokens")) == {"exact_match": exact_match, "even_tokens": even_tokens}
    assert step_hooks(()) == (evaluate, write_metrics, write_transcripts)
    assert step_hooks(("record_for_the_test",)) == (evaluate, record, write_metrics, write_transcripts)
    with pytest.raises(ConfigError, match=r"^train\.hooks must be one of \(.*'record_for_the_test'.*\), got "
                                          r"'no_such_hook'$"):
        step_hooks(("record_for_the_test", "no_such_hook"))
    with pytest.raises(ConfigError, match=r"^reward\.functions must be one of \('exact_match', .*\), got 'f1'$"):
        named_rewards(("exact_match", "f1"))
    with pytest.raises(ConfigError, match=r"^reward\.functions names a function twice"):
        named_rewards(("exact_match", "exact_match"))
    with pytest.raises(ConfigError, match=r"^reward\.functions names no reward function$"):
        named_rewards(())


def test_a_trainer_with_an_unknown_hook_name_fails_naming_the_key(tiny_assets, tmp_path):
    cfg = tiny_trainer_config(tiny_assets, str(tmp_path / "run"))
    cfg.train.hooks = ("no_such_hook",)
    with pytest.raises(ConfigError, match=r"^train\.hooks must be one of .*, got 'no_such_hook'$"):
        launched(cfg)  # the launch's validation
    assert not (tmp_path / "run").exists()  # before anything was built or written


@pytest.mark.slow
def test_a_named_reward_moves_the_advantages_and_a_named_hook_sees_every_steps_metrics_and_its_run(tiny_assets,
                                                                                                 tmp_path,
                                                                                                 monkeypatch):
    """Two steps of 2 prompts x 4 samples with exact match plus `even_tokens` and the named hook `record`, both
    from the config: each step's batch carries the summed rewards and their NumPy GRPO advantages; the hook runs
    after each step, after the evaluation (its metrics of step 2 are there) and before the metrics record (the
    metric it adds is in the log), with the run's context."""
    cfg = tiny_trainer_config(tiny_assets, str(tmp_path / "run"))
    cfg.reward.functions = ("exact_match", "even_tokens")
    cfg.train.hooks = ("record_for_the_test",)
    SEEN.clear()
    trainer = trainer_lib.Trainer(*launched(cfg))
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

    assert [step for step, _, _, _ in SEEN] == [1, 2]
    with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
        logged = [record for record in map(json.loads, f) if record["step"] > 0]  # (step 0: the start's eval)
    for (step, metrics, trajectories, run), batch, record_ in zip(SEEN, batches, logged):
        em_b = exact_match(trajectories, run.config.reward)
        np.testing.assert_allclose(batch.rewards_b, em_b + even_tokens(trajectories, run.config.reward), rtol=1e-6)
        assert any(np.ptp(batch.rewards_b[batch.group_b == g]) > 0 for g in set(batch.group_b.tolist()))
        np.testing.assert_allclose(batch.advantages_b, numpy_grpo(batch.rewards_b, batch.group_b), atol=1e-4)
        assert metrics["reward/exact_match"] == pytest.approx(float(em_b.mean()))
        even_b = even_tokens(trajectories, run.config.reward)
        assert metrics["reward/even_tokens"] == pytest.approx(float(even_b.mean()))
        assert metrics["reward/mean"] == pytest.approx(metrics["reward/exact_match"] + metrics["reward/even_tokens"])
        assert record_["step"] == step and record_["reward/even_tokens"] == pytest.approx(metrics["reward/even_tokens"])
        assert record_["test/hook_step"] == step
        assert str(run.run_dir) == str(tmp_path / "run") and run.is_main
        assert run.config.reward.functions == ("exact_match", "even_tokens") and run.config.train.total_steps == 2
        assert run.tokenizer.decode(trajectories[0].tokens.tolist())  # the run's tokenizer reads its tokens
        assert run.evaluate is not None
    assert "eval/em_mean" in SEEN[1][1] and "eval/em_mean" not in SEEN[0][1]
