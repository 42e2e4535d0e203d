"""Fixtures of the RL tests: random multi-turn rollout batches, a tiny model, shared (compiled-once) train steps."""
import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.rl.advantages import grpo_advantages
from llds_jax.rl.batch import RolloutBatch
from llds_jax.config.sections import ObjectiveConfig, UpdateConfig
from llds_jax.rl.llds import action_ids_from_loss_mask
from llds_jax.rl.train_step import RLTrainStep
from tests.placement import shard_model

TINY_MODEL = dict(vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                  head_dim=8)
STEP_BATCH, STEP_TIME = 32, 24
# One log-prob chunk per sequence keeps compile time low; the multi-chunk path is tested in test_logprobs. A float32
# reference copy: the exact-value checks score the reference with float32 forwards (bfloat16 is tested on its own).
STEP_UPDATE = UpdateConfig(mini_batch_size=16, micro_batch_size=4, learning_rate=1e-3, logp_time_chunk=32,
                           reference_dtype="float32")


def random_rollout(seed: int, batch: int, time: int, vocab: int, group: int = 4) -> RolloutBatch:
    """A random rollout batch, built like real trajectories, its rewards and GRPO advantages set.

    Each row: left padding (0-3), a 3-token prompt, then 1-3 model turns (2-4 tokens, loss mask 1) separated by
    observations (2-3 tokens, loss mask 0), the last 2 tokens of the last turn the answer span, then right padding.
    Groups of `group` rows share a uid; rewards are mixed, and group 1 has all-equal rewards (advantages 0). The
    action ids are the maximal runs of the loss mask; the sampler's log-probs are 0.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, time)).astype(np.int32)
    mask = np.zeros((batch, time), np.float32)
    loss_mask = np.zeros((batch, time), np.float32)
    answer = np.zeros((batch, time), np.float32)
    searches = np.zeros(batch, np.float32)
    for row in range(batch):
        pos = int(rng.integers(0, 4))
        start = pos
        pos += 3
        turns = int(rng.integers(1, 4))
        for turn in range(turns):
            length = int(rng.integers(2, 5))
            if pos + length > time:
                break
            loss_mask[row, pos:pos + length] = 1
            last_turn = (pos, pos + length)
            pos += length
            if turn < turns - 1:
                searches[row] += 1
                pos += int(rng.integers(2, 4))
        end = min(pos, time)
        mask[row, start:end] = 1
        answer[row, max(last_turn[1] - 2, last_turn[0]):last_turn[1]] = 1
    rewards = rng.integers(0, 2, batch).astype(np.float32)
    rewards[group:2 * group] = 1.0
    group_b = (np.arange(batch) // group).astype(np.int32)
    return RolloutBatch(tokens_bt=tokens, mask_bt=mask, loss_mask_bt=loss_mask,
                        action_ids_bt=np.asarray(action_ids_from_loss_mask(loss_mask)), answer_mask_bt=answer,
                        sampler_logp_bt=np.zeros((batch, time), np.float32), group_b=group_b,
                        search_count_b=searches, rewards_b=rewards,
                        advantages_b=np.asarray(grpo_advantages(rewards, group_b)))


@pytest.fixture(scope="session")
def host_copy():
    """`host_copy(tree)`: a numpy copy of a pytree (survives the donation of the device buffers)."""
    return _host_copy


@pytest.fixture(scope="session")
def make_rollout():
    """`random_rollout` (seed, batch, time, vocab) -> RolloutBatch."""
    return random_rollout


@pytest.fixture(scope="session")
def tiny_model_cfg():
    return ModelConfig.tiny(**TINY_MODEL)


@pytest.fixture(scope="session")
def step_batch(tiny_model_cfg):
    """The rollout batch the shared train steps train on: 32 trajectories = 2 updates of 4 micro-batches of 4."""
    return random_rollout(0, STEP_BATCH, STEP_TIME, tiny_model_cfg.vocab_size)


def _make_step(cfg, mesh):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if mesh is not None:
        shard_model(model, mesh)
    return RLTrainStep(model, ObjectiveConfig(), STEP_UPDATE, mesh=mesh)


@pytest.fixture(scope="session")
def plain_step(tiny_model_cfg):
    """An unsharded train step on the tiny model (compiled once, shared by the train-step tests)."""
    return _make_step(tiny_model_cfg, None)


@pytest.fixture(scope="session")
def plain_step_result(plain_step, step_batch):
    """(initial params as numpy, state after one train_on_batch, metrics) of the unsharded step."""
    state = plain_step.init_state()
    initial = _host_copy(state.params)
    ref = plain_step.reference_params(state.params)
    state, metrics = plain_step.train_on_batch(state, ref, step_batch, measure_lld=True)
    return initial, state, metrics


@pytest.fixture(scope="session")
def mesh8():
    """data 2 x fsdp 2 x tensor 2 over the 8 fake CPU devices."""
    return parallel.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="session")
def sharded_step(tiny_model_cfg, mesh8):
    return _make_step(tiny_model_cfg, mesh8)


def _host_copy(tree):
    """A host (numpy) copy of a pytree of arrays (survives the donation of the device buffers)."""
    return jax.tree.map(np.array, jax.device_get(tree))
