"""Parity of the per-micro-batch objective with the PyTorch reference of bench/train_step.py (written from
docs/method.md): the loss value and its gradients with respect to logp and entropy."""
import functools
import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest
import torch

from llds_jax.config.sections import LLDSConfig, ObjectiveConfig
from llds_jax.rl.losses import objective_loss
from llds_jax.rl.terms import LossInputs, batch_statistics

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "train_step.py"


@functools.cache
def torch_objective_loss():
    """bench/train_step.py's `torch_objective_loss` (the module registered first: its dataclasses need it)."""
    spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.torch_objective_loss


@pytest.mark.parametrize("objective", [
    ObjectiveConfig(),
    ObjectiveConfig(entropy_coef=0.3, kl_coef=0.5, kl_clamp=2.0, ratio_cap=3.0, llds=LLDSConfig(lam=0.7)),
    ObjectiveConfig(kl_coef=0.5, llds=LLDSConfig(enabled=False)),
], ids=["default", "large-coefficients", "no-llds"])
def test_objective_and_its_gradients_match_the_torch_reference(make_rollout, objective):
    roll = make_rollout(3, 16, 24, 50)
    rng = np.random.default_rng(1)
    shape = roll.loss_mask_bt.shape
    old = -rng.uniform(0.1, 3.0, shape).astype(np.float32)
    logp = (old + rng.normal(0.0, 0.4, shape)).astype(np.float32)  # ratios inside and outside the clip range
    logp[0, np.flatnonzero(roll.loss_mask_bt[0])[0]] = old[0, np.flatnonzero(roll.loss_mask_bt[0])[0]] + 5.0  # cap
    ref = (logp + rng.normal(0.0, 1.5, shape)).astype(np.float32)  # k3 values beyond the clamp
    entropy = rng.uniform(0.5, 4.0, shape).astype(np.float32)
    advantages = roll.advantages_b
    assert (advantages > 0).any() and (advantages < 0).any() and (advantages == 0).any()

    stats = batch_statistics(roll, objective)

    def ours(logp_bt, entropy_bt):
        inputs = LossInputs(logp_bt, entropy_bt, old, ref, advantages, roll.loss_mask_bt, roll.action_ids_bt,
                            roll.answer_mask_bt, stats)
        return objective_loss(inputs, objective)[0]

    loss, (grad_logp, grad_entropy) = jax.jit(jax.value_and_grad(ours, argnums=(0, 1)))(logp, entropy)

    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731  (a writable copy)
    logp_t, entropy_t = t(logp).requires_grad_(), t(entropy).requires_grad_()
    want = torch_objective_loss()(objective, logp_t, entropy_t, t(old), t(ref), t(advantages), t(roll.loss_mask_bt),
                                  t(roll.action_ids_bt.astype(np.int64)))
    want.backward()
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad_logp), logp_t.grad.numpy(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(np.asarray(grad_entropy), entropy_t.grad.numpy(), rtol=1e-5, atol=1e-9)
    assert np.count_nonzero(np.asarray(grad_logp)) > 0.5 * roll.loss_mask_bt.sum()
