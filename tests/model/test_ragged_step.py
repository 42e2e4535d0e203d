"""Transformer.ragged_step over the paged KV cache: conversations fed as prompt chunks, decode tokens and observation
chunks of several sequences in the same ragged batches, one sequence on another's prompt pages, give the logits of a
full forward of each whole sequence and leave in the pages the keys and values of each layer of that forward;
sharded by key/value heads over 8 CPU devices they give the unsharded logits."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer, init_pages, pages_spec
from llds_jax.model import rope as rope_lib
from llds_jax.model import transformer as transformer_lib
from tests.placement import shard_model

Z, TOKENS, MAX_SEQS, PAGES_PER_SEQ, POOL = 4, 16, 4, 8, 40


def _plan(seed, vocab):
    """Steps of (sequence, new tokens, fork): fork (parent, n) starts the sequence on the parent's first n tokens
    (n a multiple of Z: the parent's full pages, shared)."""
    rng = np.random.default_rng(seed)
    tok = lambda n: [int(x) for x in rng.integers(1, vocab, n)]  # noqa: E731
    a_prompt = tok(10)
    return [
        [("A", a_prompt, None), ("C", tok(5), None)],                        # two prompts (C: a page and a bit)
        [("A", tok(1), None), ("C", tok(6), None), ("B", tok(4), ("A", 8))],  # decode; C's chunk continues a page
        [("A", tok(5), None), ("B", tok(1), None), ("C", tok(1), None)],      # A's observation, decodes
        [("C", tok(1), None), ("B", tok(7), None), ("A", tok(1), None)],      # B's observation
    ]


def _run(step_fn, pool, plan, seed=0):
    """Feeds the plan through `step_fn` as an engine would (pages from a shuffled free list). Returns (per step
    {sequence: (logits [V], its position)}, the padding sequences' logits, tokens and pages per sequence, pool)."""
    free = list(np.random.default_rng(seed).permutation(POOL))
    tokens, pages, results, padding = {}, {}, [], []
    for step in plan:
        batch, cu, kv_lens = [], [0], []
        table = np.zeros((MAX_SEQS, PAGES_PER_SEQ), np.int32)
        for row, (name, new, fork) in enumerate(step):
            if fork is not None:
                parent, n = fork
                tokens[name], pages[name] = tokens[parent][:n], pages[parent][:n // Z]
            tokens[name] = tokens.get(name, []) + new
            pages[name] = pages.get(name, [])
            while len(pages[name]) * Z < len(tokens[name]):
                pages[name].append(free.pop())
            table[row, :len(pages[name])] = pages[name]
            batch += new
            cu.append(cu[-1] + len(new))
            kv_lens.append(len(tokens[name]))
        num = len(step)
        args = (np.pad(batch, (0, TOKENS - len(batch))), np.pad(kv_lens, (0, MAX_SEQS - num)), table,
                np.pad(cu, (0, MAX_SEQS - num), constant_values=cu[-1]), [num])
        logits, pool = step_fn(pool, *(jnp.asarray(a, jnp.int32) for a in args))
        logits = np.asarray(logits)
        results.append({name: (logits[row], len(tokens[name]) - 1) for row, (name, _, _) in enumerate(step)})
        padding.append(logits[num:])
    return results, padding, tokens, pages, pool


def _step_fn(model, mesh=None):
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(state, pool, *batch):
        return nnx.merge(graphdef, state).ragged_step(batch[0], pool, *batch[1:])

    if mesh is None:
        return functools.partial(step, state)

    def sharded(pool, *batch):
        with jax.set_mesh(mesh):
            return step(state, pool, *batch)
    return sharded


def _layer_keys_values(model, rows_bt, mask_bt):
    """Each layer's keys and values [L, B, T, K, H] in a full forward of right-padded rows: the model's own block
    functions, run one layer at a time (checked: the final hidden states are `Transformer.hidden`'s)."""
    cfg = model.cfg
    mask = jnp.asarray(mask_bt, bool)
    cos, sin = rope_lib.rope_angles(jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0), rope_lib.inverse_frequencies(cfg))
    slot_bt = jnp.broadcast_to(jnp.arange(mask.shape[1], dtype=jnp.int32), mask.shape)
    x_btd, keys, values = model._embed(rows_bt), [], []
    for layer in range(cfg.num_layers):
        p = jax.tree.map(lambda a: a[layer], model.layers.arrays())
        _, k, v = transformer_lib._qkv(cfg, x_btd, p, transformer_lib._compute_weights(cfg, p), cos, sin)
        keys.append(k)
        values.append(v)
        x_btd = transformer_lib._block(cfg, x_btd, p, cos, sin, slot_bt, mask, None)
    hidden = transformer_lib.rms_norm(x_btd, model.final_norm.get_value(), cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(model.hidden(rows_bt, mask_bt)), atol=1e-5)
    return np.stack(keys), np.stack(values)


def test_ragged_steps_equal_full_forwards_and_fill_pages_with_its_keys_and_values():
    cfg = ModelConfig.tiny()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    pool = init_pages(cfg, POOL, Z)
    results, padding, tokens, pages, pool = _run(_step_fn(model), pool, _plan(1, cfg.vocab_size))
    # One full forward of every whole sequence (right-padded rows).
    names = sorted(tokens)
    width = max(len(tokens[name]) for name in names)
    rows = jnp.asarray([tokens[name] + [0] * (width - len(tokens[name])) for name in names])
    mask = jnp.asarray([[i < len(tokens[name]) for i in range(width)] for name in names])
    full = dict(zip(names, np.asarray(model(rows, mask))))
    keys, values = _layer_keys_values(model, rows, mask)
    for step in results:
        for name, (logits, position) in step.items():
            np.testing.assert_allclose(logits, full[name][position], rtol=1e-5, atol=1e-5, err_msg=name)
    assert all(np.all(p == 0) for p in padding) and sum(len(p) for p in padding) == 5
    assert pages["B"][:2] == pages["A"][:2] and not set(pages["B"][2:]) & set(pages["A"])
    # Each layer's keys and values of every token, where its page says, are the full forward's.
    pool = np.asarray(pool)
    for row, name in enumerate(names):
        n = len(tokens[name])
        page_i, offset_i = np.asarray(pages[name])[np.arange(n) // Z], np.arange(n) % Z
        for half, want in ((0, keys), (1, values)):
            np.testing.assert_allclose(pool[:, page_i, offset_i, half::2], want[:, row, :n], atol=1e-6)


def test_pool_is_donated():
    cfg = ModelConfig.tiny(num_layers=1)
    pool = init_pages(cfg, POOL, Z)
    _, _, _, _, out = _run(_step_fn(Transformer(cfg, rngs=nnx.Rngs(0))), pool, _plan(2, cfg.vocab_size)[:1])
    assert pool.is_deleted() and not out.is_deleted()


def test_heads_sharded_over_eight_devices_give_the_unsharded_logits():
    """Key/value heads (and the pool's combined heads) split over tensor = 2, parameters over fsdp = 4."""
    cfg = ModelConfig.tiny()
    mesh = parallel.make_mesh(data=1, fsdp=4, tensor=2)
    plan = _plan(3, cfg.vocab_size)
    want, _, _, _, _ = _run(_step_fn(Transformer(cfg, rngs=nnx.Rngs(0))), init_pages(cfg, POOL, Z), plan)
    spec = pages_spec(mesh, cfg.num_kv_heads)
    assert spec == jax.sharding.PartitionSpec(None, None, None, "tensor", None)
    pool = jax.device_put(init_pages(cfg, POOL, Z), NamedSharding(mesh, spec))
    model = shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
    got, _, _, _, pool = _run(_step_fn(model, mesh), pool, plan)
    assert pool.sharding.is_equivalent_to(NamedSharding(mesh, spec), pool.ndim)
    assert pool.addressable_shards[0].data.shape == (2, POOL, Z, 2, 8)  # one of the two kv heads per device
    for got_step, want_step in zip(got, want):
        assert got_step.keys() == want_step.keys()
        for name in got_step:
            np.testing.assert_allclose(got_step[name][0], want_step[name][0], rtol=1e-5, atol=1e-5)
