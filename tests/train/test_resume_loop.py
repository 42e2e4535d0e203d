"""The pieces wired as the trainer loop uses them: a SIGTERM mid-run, checkpoint, resume; same result as no stop."""
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from llds_jax.data.iterator import PromptIterator
from llds_jax.train.checkpoint import Checkpointer, rng_from_json, rng_to_json
from llds_jax.train.preemption import PreemptionGuard

TOTAL_STEPS = 6


def train(run_dir, examples, mesh, stop_after=None):
    """Toy loop: params += f(batch, rng); returns (params, batches seen, last step)."""
    sharding = NamedSharding(mesh, P("data"))
    init = {"w": jax.device_put(jnp.zeros(8), sharding)}
    opt_state = {"count": jax.device_put(jnp.int32(0), NamedSharding(mesh, P()))}
    data = PromptIterator(examples, batch_size=4, seed=11)
    rng = jax.random.key(0)
    ckpt = Checkpointer(str(run_dir), save_every=4, keep=2)
    params, start, seen = init, 0, []
    restored = ckpt.restore_latest(init, opt_state)
    if restored is not None:
        params, opt_state, start = restored.params, restored.opt_state, restored.step
        data.restore(restored.meta["data"])
        rng = rng_from_json(restored.meta["rng"])
    with PreemptionGuard() as guard:
        guard.defer()  # a signal is recorded for should_stop (the training loop's mode)
        for step in range(start + 1, TOTAL_STEPS + 1):
            batch = next(data)
            seen.append([ex.uid for ex in batch])
            rng, key = jax.random.split(rng)
            ids = jnp.asarray([int(ex.uid.split("-")[1]) for ex in batch], jnp.float32)
            params = {"w": params["w"] + ids.sum() * jax.random.uniform(key, (8,))}
            opt_state = {"count": opt_state["count"] + 1}
            if step == stop_after:
                os.kill(os.getpid(), signal.SIGTERM)  # e.g. spot preemption
                time.sleep(0.01)
            stop = guard.should_stop()
            if stop or ckpt.should_save(step):
                ckpt.save(step, params, opt_state, {"data": data.state(), "rng": rng_to_json(rng)})
            if stop:
                break
    ckpt.close()
    return params, opt_state, seen, step


def test_preempted_and_resumed_run_matches_an_uninterrupted_one(tmp_path, make_examples, mesh):
    examples = make_examples(10)
    expected, expected_opt, all_batches, _ = train(tmp_path / "straight", examples, mesh)

    _, _, first, stopped_at = train(tmp_path / "preempted", examples, mesh, stop_after=3)
    assert stopped_at == 3 and sorted(os.listdir(tmp_path / "preempted")) == ["3"]
    params, opt_state, rest, _ = train(tmp_path / "preempted", examples, mesh)
    assert first + rest == all_batches
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(expected["w"]))
    assert int(opt_state["count"]) == int(expected_opt["count"]) == TOTAL_STEPS
    assert params["w"].sharding == expected["w"].sharding
    assert sorted(os.listdir(tmp_path / "preempted")) == ["3", "4"]
