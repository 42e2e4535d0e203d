"""Transformer.ragged_step with the Pallas ragged paged attention kernel, compiled by XLA's TPU compiler (libtpu) for a
v4 topology on this CPU: the kernel is in the program, each chip holds its key/value heads' share of the pool, which
the step updates in place (donated, never copied or gathered)."""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from llds_jax import parallel
from llds_jax.aot import compile_check
from llds_jax.model import ModelConfig, Transformer, pages_spec

TOKENS, MAX_SEQS, PAGES_PER_SEQ, POOL, Z = 64, 8, 8, 1024, 16


def test_ragged_step_compiles_for_v4_with_the_kernel_and_updates_the_pool_in_place():
    devices, _ = compile_check.topology_devices("v4:2x2x1")
    mesh = parallel.make_mesh(data=1, fsdp=1, tensor=4, devices=devices)
    cfg = ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4,
                           head_dim=128, dtype="bfloat16", param_dtype="bfloat16", attention_platform="tpu")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    pool_shape = (cfg.num_layers, POOL, Z, 2 * cfg.num_kv_heads, cfg.head_dim)
    pool = jax.ShapeDtypeStruct(pool_shape, jnp.bfloat16, sharding=NamedSharding(mesh, pages_spec(
        mesh, cfg.num_kv_heads)))
    int32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, P()))  # noqa: E731

    def step(params, pool, tokens, kv_lens, table, cu, num):
        return nnx.merge(graphdef, params).ragged_step(tokens, pool, kv_lens, table, cu, num)

    # Inside the mesh: Mosaic's lowering asks the mesh's devices (TPU v4), not JAX's backend (CPU), for the chip.
    with compile_check.no_persistent_cache_writes(), jax.set_mesh(mesh):
        compiled = jax.jit(step, donate_argnums=1).lower(
            parallel.abstract_params(state, mesh), pool, int32(TOKENS), int32(MAX_SEQS),
            int32(MAX_SEQS, PAGES_PER_SEQ), int32(MAX_SEQS + 1), int32(1)).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") == 1 and "ragged_paged_attention_kernel" in text  # in the layer scan
    memory = compiled.memory_analysis()
    pool_per_chip = 2 * POOL * Z * (2 * 4 // 4) * 128 * 2  # layers x pages x slots x its 2 combined heads x H, bf16
    assert pool_per_chip == 16 << 20
    assert memory.alias_size_in_bytes == pool_per_chip  # the pool's buffer is the output's
    assert memory.temp_size_in_bytes < pool_per_chip / 8  # no copy of the pool (measured 0.9 MiB)
    assert compile_check.all_gather_shapes(text) == []
    assert compiled.output_shardings[1].is_equivalent_to(pool.sharding, len(pool_shape))
