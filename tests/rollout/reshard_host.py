"""One host of `test_reshard_hosts.py`: process `pid` of 2 on loopback `port`, 4 CPU devices each.

    python -m tests.rollout.reshard_host PID PORT

The tiny model's params on a training mesh over both hosts' 8 devices (fsdp over all of them), twice: in the id
order `parallel.make_mesh` gives, and interleaving the hosts (0, 4, 1, 5, ...) as a TPU pod's torus rings do. For each
rollout layout (the training layout on a host's chips, tensor parallelism over 2 and over 4 chips: key/value heads
repeated), `rollout_params` (with `process_allgather` made to raise) against the copy through host memory it
replaced: every array equal bit for bit, on this host's rollout mesh with the same sharding. Prints one "same ..."
line per case.
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"


def main(pid: int, port: int) -> None:
    from llds_jax.runtime import distributed

    distributed.maybe_initialize(f"127.0.0.1:{port}", 2, pid)
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from llds_jax import parallel
    from llds_jax.model import ModelConfig, Transformer
    from llds_jax.rollout import layout as layout_lib

    model_cfg = ModelConfig.tiny(mlp_chunks=2)  # 4 query heads, 2 key/value heads
    values = nnx.split(Transformer(model_cfg, rngs=nnx.Rngs(0)))[1]  # the same on both hosts
    by_id = parallel.make_mesh(1, -1, 1)
    devices = list(by_id.devices.flat)
    interleaved = Mesh(np.array([devices[i // 2 + 4 * (i % 2)] for i in range(8)]).reshape(by_id.devices.shape),
                       by_id.axis_names)
    allgather = multihost_utils.process_allgather

    def through_host_memory(layout, params):  # the copy `rollout_params` made before: gathered on every host
        params = layout_lib.cast_params(params, "bfloat16")
        if layout.kv_repeat > 1:
            params = layout_lib._repeat_kv_heads_jit(params, layout.kv_repeat)
        return jax.device_put(allgather(params, tiled=True), parallel.param_shardings(params, layout.mesh))

    def refuse(*args, **kwargs):
        raise AssertionError("process_allgather on the rollout path")

    for name, mesh in (("id-order", by_id), ("interleaved", interleaved)):
        params = jax.tree.map(lambda v, s: jax.make_array_from_callback(v.shape, s, lambda i, v=v: np.asarray(v)[i]),
                              values, parallel.param_shardings(values, mesh))
        for setting in (0, 2, 4):
            layout = layout_lib.make_layout(setting, model_cfg, mesh, jax.local_devices())
            expected = through_host_memory(layout, params)
            multihost_utils.process_allgather = refuse
            try:
                got = layout_lib.rollout_params(layout, params, "bfloat16")
            finally:
                multihost_utils.process_allgather = allgather
            pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(expected)))
            for g, e in pairs:
                assert g.is_fully_addressable and g.sharding == e.sharding, (g.sharding, e.sharding)
                assert g.dtype == e.dtype and np.array_equal(np.asarray(g), np.asarray(e), equal_nan=True)
            print(f"same {name} tensor_parallel={setting} kv_repeat={layout.kv_repeat}: {len(pairs)} arrays",
                  flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
