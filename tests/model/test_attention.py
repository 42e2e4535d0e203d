"""Blockwise (online-softmax) attention equals the dense reference on values and gradients, alone and inside the
model's full forwards, and never holds a [T, S] float32 score buffer; splash and cudnn match it on real tokens."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.model import attention as attention_lib
from llds_jax.model.attention import blockwise_attention, dense_attention
from tests.placement import shard_model

# Worst absolute difference allowed, relative to the largest magnitude of the compared array. Float32: rounding
# only (measured at most 4.3e-7). Bfloat16: both paths round the probabilities and the products to 8 mantissa bits
# (2^-8 = 3.9e-3 per rounding) at other points (the dense path its normalized softmax, the blockwise one each tile's
# unnormalized exp and its outputs); measured at most 7.2e-3 (dk), 1.5e-2 leaves 2x headroom.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.5e-2}


def _inputs(seed, b, t, s, n, k, h, dtype):
    rng = np.random.default_rng(seed)
    q, kk, v, w = (jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
                   for shape in ((b, t, n, h), (b, s, k, h), (b, s, k, h), (b, t, n, h)))
    return q, kk, v, w


def _full_forward_vectors(mask_bt):
    """What Transformer.hidden passes: query t sees the real tokens up to t."""
    mask = jnp.asarray(mask_bt, bool)
    return jnp.broadcast_to(jnp.arange(mask.shape[1], dtype=jnp.int32), mask.shape), mask


def _padding(b, t, kind):
    mask = np.ones((b, t), bool)
    if kind == "left":
        for row, pad in enumerate((0, 5, t - 1)[:b]):
            mask[row, :pad] = False
    elif kind == "right":
        for row, keep in enumerate((t, 7, 1)[:b]):
            mask[row, keep:] = False
    elif kind == "fully_padded_row":
        mask[1] = False
        mask[0, :3] = False
    return mask


def _assert_close(got, want, dtype, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= TOLERANCE[dtype], f"{what}: max |blockwise - dense| / max |dense| = {err:.2e}"


def _value_and_grads(fn, q, kk, v, w):
    """fn's output and the gradients of sum(w * out) w.r.t. q, k, v."""
    def loss(q, kk, v):
        return jnp.sum(fn(q, kk, v).astype(jnp.float32) * w.astype(jnp.float32))
    return jax.jit(lambda q, kk, v: (fn(q, kk, v), jax.grad(loss, argnums=(0, 1, 2))(q, kk, v)))(q, kk, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("padding", ["none", "left", "right", "fully_padded_row"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
def test_full_forward_parity_values_and_gradients(dtype, padding, heads):
    """T = 37 in query blocks of 8 (5 blocks, the last padded) and key blocks of 5 (8 blocks, the last padded)."""
    n, k = heads
    b, t = 3, 37
    q, kk, v, w = _inputs(0, b, t, t, n, k, 8, jnp.dtype(dtype))
    slot, valid = _full_forward_vectors(_padding(b, t, padding))
    ref, ref_grads = _value_and_grads(lambda q, kk, v: dense_attention(q, kk, v, slot, valid), q, kk, v, w)
    got, got_grads = _value_and_grads(
        lambda q, kk, v: blockwise_attention(q, kk, v, slot, valid, query_block=8, key_block=5), q, kk, v, w)
    assert got.dtype == ref.dtype == jnp.dtype(dtype) and got.shape == ref.shape
    _assert_close(got, ref, dtype, "out")
    for name, g, r in zip(("dq", "dk", "dv"), got_grads, ref_grads):
        assert g.dtype == r.dtype
        _assert_close(g, r, dtype, name)


def test_queries_at_offsets_over_keys_with_holes_parity():
    """Visibility vectors other than a full forward's: S = 29 key slots with holes, T = 11 queries at each row's
    own offset into them, row 0's first queries seeing no key."""
    b, t, s = 3, 11, 29
    q, kk, v, w = _inputs(1, b, t, s, 6, 2, 16, jnp.float32)
    rng = np.random.default_rng(2)
    valid = rng.random((b, s)) < 0.7
    start = np.array([0, 9, 18])
    slot = start[:, None] + np.arange(t)[None, :]
    valid[0, :4] = False  # row 0: its first queries see nothing
    slot, valid = jnp.asarray(slot, jnp.int32), jnp.asarray(valid)
    ref, ref_grads = _value_and_grads(lambda q, kk, v: dense_attention(q, kk, v, slot, valid), q, kk, v, w)
    for blocks in ((4, 4), (11, 29), (3, 7), (512, 512)):
        got, got_grads = _value_and_grads(lambda q, kk, v: blockwise_attention(
            q, kk, v, slot, valid, query_block=blocks[0], key_block=blocks[1]), q, kk, v, w)
        _assert_close(got, ref, "float32", f"out {blocks}")
        for name, g, r in zip(("dq", "dk", "dv"), got_grads, ref_grads):
            _assert_close(g, r, "float32", f"{name} {blocks}")


def test_a_query_that_sees_no_key_gets_the_uniform_average_of_all_slots():
    """The dense path's float32 softmax over S equal masked scores; its gradient reaches v only (by 1 / S)."""
    b, t, s = 2, 6, 9
    q, kk, v, w = _inputs(3, b, t, s, 2, 1, 8, jnp.float32)
    slot = jnp.asarray([[-1] * t, [8] * t], jnp.int32)  # row 0 sees nothing; row 1 all valid slots
    valid = jnp.asarray([[True] * s, [False] * s])      # ... of which there are none
    mean_bkh = np.asarray(v).mean(axis=1)
    for fn in (dense_attention, lambda *a: blockwise_attention(*a, query_block=4, key_block=4)):
        out, (dq, dk, dv) = _value_and_grads(lambda q, kk, v: fn(q, kk, v, slot, valid), q, kk, v, w)
        np.testing.assert_allclose(np.asarray(out), np.broadcast_to(mean_bkh[:, None, :, :], out.shape), atol=1e-6)
        assert not np.any(np.asarray(dq)) and not np.any(np.asarray(dk))
        want_dv = np.asarray(w).sum(axis=(1, 2))[:, None, None, :] / s
        np.testing.assert_allclose(np.asarray(dv), np.broadcast_to(want_dv, dv.shape), atol=1e-6)


def test_block_size_is_an_upper_bound_and_must_be_positive():
    assert attention_lib.blocks(37, 8) == (5, 8) and attention_lib.blocks(600, 512) == (2, 300)
    assert attention_lib.blocks(512, 512) == (1, 512) and attention_lib.blocks(1, 512) == (1, 1)
    with pytest.raises(ValueError, match="attention block size must be >= 1, got 0"):
        attention_lib.blocks(10, 0)


def test_auto_is_blockwise_beyond_one_tile_and_one_query_is_dense():
    assert attention_lib.resolve("auto", 513, 513, 512, 512) == "blockwise"   # a long forward
    assert attention_lib.resolve("auto", 512, 512, 512, 512) == "xla"         # one tile
    assert attention_lib.resolve("auto", 512, 8192, 512, 512) == "blockwise"  # queries over many more keys
    assert attention_lib.resolve("auto", 32, 8192, 512, 512) == "xla"         # a few queries: 1 tile's worth
    assert attention_lib.resolve("auto", 1, 32768, 512, 512) == "xla"         # one query
    assert attention_lib.resolve("blockwise", 2, 2, 512, 512) == "blockwise"
    assert attention_lib.resolve("blockwise", 1, 4096, 512, 512) == "xla"
    assert attention_lib.resolve("xla", 4096, 4096, 512, 512) == "xla"
    with pytest.raises(ValueError, match="attention implementation must be one of"):
        attention_lib.resolve("flash", 8, 8, 512, 512)


@pytest.mark.parametrize("field, value, message", [
    ("attention", "flash",
     r"model\.attention must be one of 'auto', 'xla', 'blockwise', 'splash', 'cudnn', got 'flash'"),
    ("attention_platform", "metal", r"model\.attention_platform must be None or one of \('cpu', 'gpu', 'tpu'\)"),
    ("attention_query_block", 0, r"model\.attention_query_block must be >= 1, got 0"),
    ("attention_key_block", 1.5, r"model\.attention_key_block must be an integer >= 1, got 1\.5"),
])
def test_model_config_rejects_bad_attention_settings(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**{field: value})


# --- inside the model -------------------------------------------------------------------------------------------

SMALL_BLOCKS = dict(attention_query_block=4, attention_key_block=3)


def _models(**overrides):
    """The same random weights under the dense and the blockwise path (small tiles: many blocks, ragged ends)."""
    dense = Transformer(ModelConfig.tiny(attention="xla", **overrides), rngs=nnx.Rngs(0))
    blockwise = Transformer(ModelConfig.tiny(attention="blockwise", **SMALL_BLOCKS, **overrides), rngs=nnx.Rngs(0))
    return dense, blockwise


def _batch():
    rng = np.random.default_rng(4)
    tokens = rng.integers(1, 256, size=(3, 13))
    mask = np.ones((3, 13), np.int32)
    mask[0, :5] = 0    # left padding
    mask[1, 9:] = 0    # right padding
    mask[2, :] = 0     # a row of padding only
    return jnp.asarray(tokens), jnp.asarray(mask)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_model_parameter_gradients_agree(remat):
    """(The hidden states: test_model_hidden_states_agree_padding_rows_included.)"""
    dense, blockwise = _models(remat=remat)
    tokens, mask = _batch()

    def loss(model):
        logp = jax.nn.log_softmax(model(tokens, mask)[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    grad = nnx.jit(nnx.grad(loss))
    want, got = grad(dense), grad(blockwise)
    for (path, g), (_, r) in zip(nnx.to_flat_state(nnx.state(got)), nnx.to_flat_state(nnx.state(want))):
        g, r = np.asarray(g.get_value()), np.asarray(r.get_value())
        assert np.abs(g - r).max() <= 1e-5 * max(np.abs(r).max(), 1e-6), path


@pytest.mark.slow
def test_sharded_blockwise_update_equals_unsharded_dense():
    """On a (data 2, fsdp 2, tensor 2) mesh of fake CPU devices (batch and heads split): the jitted loss gradient
    through the blockwise model equals the unsharded dense one."""
    dense, blockwise = _models()
    tokens, mask = _batch()
    tokens, mask = jnp.concatenate([tokens, tokens[:1]]), jnp.concatenate([mask, mask[1:2]])  # 4 rows
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    blockwise = shard_model(blockwise, mesh)

    def loss(model, tokens, mask):
        logp = jax.nn.log_softmax(model(tokens, mask)[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    grad = nnx.jit(nnx.value_and_grad(loss))
    want_loss, want = grad(dense, tokens, mask)
    with jax.set_mesh(mesh):
        batch = jax.device_put((tokens, mask), parallel.batch_sharding(mesh, 2))
        got_loss, got = grad(blockwise, *batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for (path, g), (_, r) in zip(nnx.to_flat_state(nnx.state(got)), nnx.to_flat_state(nnx.state(want))):
        g, r = np.asarray(g.get_value()), np.asarray(r.get_value())
        assert np.abs(g - r).max() <= 1e-5 * max(np.abs(r).max(), 1e-6), path


@pytest.mark.slow
def test_auto_runs_blockwise_in_a_long_forward_and_dense_within_one_tile(monkeypatch):
    calls = []
    real = attention_lib.blockwise_attention

    def recording(q, *args, **kwargs):
        calls.append(q.shape[1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(attention_lib, "blockwise_attention", recording)
    model = Transformer(ModelConfig.tiny(attention="auto", attention_query_block=8, attention_key_block=8),
                        rngs=nnx.Rngs(0))
    model.hidden(jnp.ones((1, 9), jnp.int32), jnp.ones((1, 9), jnp.int32))
    assert calls == [9]  # the layer scan traces its body once
    model.hidden(jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32))  # one tile: dense
    assert calls == [9]
    forced = Transformer(ModelConfig.tiny(attention="blockwise"), rngs=nnx.Rngs(0))
    forced.hidden(jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32))
    assert calls == [9, 2]


def test_model_hidden_states_agree_padding_rows_included():
    """Every hidden state of a full forward over left, right and whole-row padding, padding positions included
    (a padding query sees no key: the same uniform average on both paths)."""
    dense, blockwise = _models()
    tokens, mask = _batch()
    hidden = nnx.jit(lambda model: model.hidden(tokens, mask))
    np.testing.assert_allclose(np.asarray(hidden(blockwise)), np.asarray(hidden(dense)), atol=1e-5, rtol=0)


# --- memory ----------------------------------------------------------------------------------------------------

_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}


def _largest_array_bytes(hlo: str) -> int:
    """Bytes of the largest array any instruction of a compiled program's HLO names."""
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) * _BYTES[dt]
             for dt, dims in re.findall(r"\b(f32|bf16|s32|pred)\[([0-9,]+)\]", hlo)]
    return max(sizes)

def _compiled(implementation, t, grad):
    """One row, 2 query heads sharing 1 key/value head, head size 16, causal over T = S = t; jitted and compiled."""
    q = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
    slot, valid = _full_forward_vectors(np.ones((1, t), bool))

    def forward(q, kk, v):
        return attention_lib.attention(q, kk, v, slot, valid, implementation=implementation)

    fn = jax.grad(lambda *args: jnp.sum(forward(*args)), argnums=(0, 1, 2)) if grad else forward
    return jax.jit(fn).lower(q, kv, kv).compile()


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward+backward"])
def test_blockwise_holds_no_score_matrix(grad):
    """At T = S = 2048 the dense scores are float32 [1, 1, 2, 2048, 2048] (32 MiB); the blockwise tiles (512 x 512)
    1/16 of that. The compiled blockwise program has no buffer with a 2048 x 2048 trailing shape, and its
    temporaries are several times smaller (measured on CPU: 64.1 vs 4.7 MiB forward, 96.3 vs 9.6 MiB with the
    backward)."""
    t = 2048
    dense, blockwise = _compiled("xla", t, grad), _compiled("blockwise", t, grad)
    square = re.compile(rf"\[[0-9,]*{t},{t}\]")
    assert square.search(dense.as_text())  # the check can fail: the reference has them
    assert not square.search(blockwise.as_text())
    dense_temp = dense.memory_analysis().temp_size_in_bytes
    blockwise_temp = blockwise.memory_analysis().temp_size_in_bytes
    assert dense_temp >= 2 * 4 * t * t  # at least one float32 [2, T, S] buffer
    assert blockwise_temp * 6 <= dense_temp, (blockwise_temp, dense_temp)


@pytest.mark.parametrize("remat", [False, True])
def test_model_gradient_under_the_layer_scan_holds_no_score_matrix(remat):
    """The gradient of a loss through the scanned layer stack (the update's shape of computation) at T = 2048: no
    array of the blockwise program is larger than one float32 score tile [B, K, G, 512, 512] (JAX would otherwise
    hoist the loop-invariant masks out of the layer scan and stack them over every tile pair); the dense one holds
    [B, K, G, T, T] float32 scores."""
    t = 2048
    tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
    largest = {}
    for implementation in ("xla", "blockwise"):
        cfg = ModelConfig.tiny(num_layers=2, remat=remat, attention=implementation)
        graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

        def loss(state, tokens):
            return jnp.sum(nnx.merge(graphdef, state).hidden(tokens, jnp.ones_like(tokens)))

        largest[implementation] = _largest_array_bytes(jax.jit(jax.grad(loss)).lower(state, tokens).compile().as_text())
    tile = 4 * 1 * 2 * 2 * 512 * 512  # float32 [B=1, K=2, G=2, 512, 512]
    assert largest["blockwise"] == tile
    assert largest["xla"] >= 4 * 1 * 2 * 2 * t * t  # (without remat, stacked over the 2 layers)


# --- splash (Pallas, interpret mode on CPU) and cudnn (its argument plumbing through JAX's xla implementation) ---

def _real_rows_value_and_grads(fn, q, kk, v, w, valid):
    """fn's output and the gradients of sum(w * out) over the real query rows only (padding rows differ by
    design: zeros from splash / cudnn, the uniform average from the dense path)."""
    return _value_and_grads(fn, q, kk, v, w * jnp.asarray(valid, w.dtype)[:, :, None, None])


def _assert_real_rows_close(got, want, valid, dtype, what):
    real = np.asarray(valid)[:, :, None, None]
    _assert_close(np.where(real, np.asarray(got, np.float32), 0), np.where(real, np.asarray(want, np.float32), 0),
                  dtype, what)


def _fused_parity(fused, dtype, padding, heads, b, t):
    n, k = heads
    q, kk, v, w = _inputs(1, b, t, t, n, k, 8, jnp.dtype(dtype))
    mask = _padding(b, t, padding)
    slot, valid = _full_forward_vectors(mask)
    ref, ref_grads = _real_rows_value_and_grads(lambda q, kk, v: dense_attention(q, kk, v, slot, valid),
                                                q, kk, v, w, mask)
    got, got_grads = _real_rows_value_and_grads(lambda q, kk, v: fused(q, kk, v, valid), q, kk, v, w, mask)
    assert got.dtype == ref.dtype == jnp.dtype(dtype) and got.shape == ref.shape
    _assert_real_rows_close(got, ref, mask, dtype, "out")
    assert not np.asarray(got)[~mask].any()  # padding query rows: zeros
    for name, g, r in zip(("dq", "dk", "dv"), got_grads, ref_grads):
        assert g.dtype == r.dtype
        _assert_close(g, r, dtype, name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("padding", ["left", "right", "fully_padded_row"])
def test_splash_parity_values_and_gradients(dtype, padding):
    """GQA (4 query heads over 2), T = 37 padded inside the wrapper to one 128 block."""
    _fused_parity(lambda q, kk, v, valid: attention_lib.splash_attention(q, kk, v, valid, interpret=True),
                  dtype, padding, (4, 2), 3, 37)


@pytest.mark.parametrize("blocks", [(128, 128), (128, 256), (200, 100)], ids=["128x128", "128x256", "256x128"])
def test_splash_parity_over_several_blocks(blocks):
    """T = 300 (not a multiple of any block): 3 x 3, 2 x 4 (padded to 512) and 2 x 3 (200 -> 256, 100 -> 128:
    padded to 512) query x key blocks; MQA, left padding."""
    query_block, key_block = blocks
    _fused_parity(lambda q, kk, v, valid: attention_lib.splash_attention(
        q, kk, v, valid, query_block=query_block, key_block=key_block, interpret=True), "float32", "left", (2, 1), 2,
        300)


def test_splash_block_is_the_config_block_in_lanes_and_at_most_the_sequence():
    assert attention_lib.splash_block(512, 4096) == 512
    assert attention_lib.splash_block(200, 4096) == 256
    assert attention_lib.splash_block(512, 37) == 128
    with pytest.raises(ValueError, match="attention block size must be >= 1, got 0"):
        attention_lib.splash_block(0, 128)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("padding", ["left", "right", "fully_padded_row"])
def test_cudnn_arguments_match_the_dense_path_through_jax_xla_implementation(dtype, padding):
    """The cudnn path's gather of real tokens to the front, causal attention limited by the sequence lengths and
    scatter back, run by jax.nn.dot_product_attention's xla implementation (cuDNN needs a GPU)."""
    _fused_parity(lambda q, kk, v, valid: attention_lib.fused_attention(q, kk, v, valid, implementation="xla"),
                  dtype, padding, (4, 2), 3, 37)


def test_cudnn_arguments_with_padding_inside_a_row():
    mask = np.ones((2, 11), bool)
    mask[0, [2, 3, 7]] = False
    mask[1, :4] = False
    q, kk, v, w = _inputs(2, 2, 11, 11, 2, 1, 8, jnp.float32)
    slot, valid = _full_forward_vectors(mask)
    want = dense_attention(q, kk, v, slot, valid)
    got = attention_lib.fused_attention(q, kk, v, valid, implementation="xla")
    _assert_real_rows_close(got, want, mask, "float32", "out")


def test_auto_picks_the_platform_kernel_for_full_forwards_only():
    resolve = attention_lib.resolve
    assert resolve("auto", 4096, 4096, 512, 512, full_forward=True, platform="tpu") == "splash"
    assert resolve("auto", 64, 64, 512, 512, full_forward=True, platform="tpu") == "splash"
    assert resolve("auto", 4096, 4096, 512, 512, full_forward=True, platform="gpu", dtype="bfloat16") == "cudnn"
    assert resolve("auto", 4096, 4096, 512, 512, full_forward=True, platform="gpu") == "blockwise"  # float32
    assert resolve("auto", 4096, 4096, 512, 512, full_forward=True, platform="cpu") == "blockwise"
    assert resolve("auto", 512, 8192, 512, 512, platform="tpu") == "blockwise"  # not a full forward
    assert resolve("auto", 1, 8192, 512, 512, platform="tpu") == "xla"          # one query
    assert resolve("splash", 4096, 4096, 512, 512, full_forward=True) == "splash"
    assert resolve("splash", 512, 8192, 512, 512, platform="tpu") == "blockwise"
    assert resolve("splash", 32, 8192, 512, 512, platform="tpu") == "xla"
    assert resolve("cudnn", 4096, 4096, 512, 512, full_forward=True, platform="gpu", dtype="float16") == "cudnn"
    assert resolve("cudnn", 1, 4096, 512, 512, platform="gpu", dtype="bfloat16") == "xla"
    # A packed row (per-query windows): cudnn has no segments, the tile rule decides.
    packed = dict(full_forward=True, platform="gpu", dtype="bfloat16", segmented=True)
    assert resolve("cudnn", 4096, 4096, 512, 512, **packed) == resolve("auto", 4096, 4096, 512, 512, **packed) == (
        "blockwise")
    assert resolve("auto", 4096, 4096, 512, 512, full_forward=True, platform="tpu", segmented=True) == "splash"
    assert resolve("xla", 4096, 4096, 512, 512, full_forward=True, platform="tpu") == "xla"
    assert resolve("blockwise", 4096, 4096, 512, 512, full_forward=True, platform="gpu") == "blockwise"


def test_cudnn_off_gpu_or_in_float32_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"model\.attention='cudnn' needs a GPU .* platform 'cpu'"):
        attention_lib.resolve("cudnn", 64, 64, 512, 512, full_forward=True, platform="cpu")
    with pytest.raises(ValueError, match=r"model\.attention='cudnn' needs model\.dtype in \('bfloat16', 'float16'\)"):
        attention_lib.resolve("cudnn", 64, 64, 512, 512, full_forward=True, platform="gpu", dtype="float32")
    with pytest.raises(ValueError, match=r"model\.attention='cudnn' needs a GPU .* devices are 'tpu'"):
        ModelConfig.tiny(attention="cudnn", attention_platform="tpu")
    model = Transformer(ModelConfig.tiny(attention="cudnn"), rngs=nnx.Rngs(0))  # platform: JAX's backend, CPU
    with pytest.raises(ValueError, match=r"model\.attention='cudnn' needs a GPU .* platform 'cpu'"):
        nnx.eval_shape(lambda m: m.hidden(jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)), model)


def test_auto_routes_by_the_configured_platform_not_the_backend(monkeypatch):
    """ModelConfig.attention_platform = "tpu" (what the compile check sets from its abstract TPU chips while JAX's
    backend is the CPU): full forwards go to splash; "cpu" does not."""
    calls = []
    monkeypatch.setattr(attention_lib, "splash_attention",
                        lambda q, kk, v, valid, first, **kw: calls.append(q.shape[1]) or jnp.zeros_like(q))

    def hidden(model, t):
        nnx.eval_shape(lambda m: m.hidden(jnp.ones((1, t), jnp.int32), jnp.ones((1, t), jnp.int32)), model)

    model = Transformer(ModelConfig.tiny(attention="auto", attention_platform="tpu"), rngs=nnx.Rngs(0))
    hidden(model, 9)
    assert calls == [9]
    hidden(Transformer(ModelConfig.tiny(attention="auto", attention_platform="cpu"), rngs=nnx.Rngs(0)), 9)
    assert calls == [9]


def test_run_builder_model_config_carries_the_devices_platform():
    from llds_jax.train import run_builder
    from llds_jax.config import default_config

    cfg = default_config()
    cfg.model.preset = "qwen2.5-0.5b"
    assert run_builder.model_config(cfg, "tpu").attention_platform == "tpu"


@pytest.mark.slow
def test_model_logp_and_parameter_gradients_agree_under_splash():
    """The tiny model's model_token_logp (hidden -> log-probs) and its parameter gradient: splash (interpret mode)
    equals the dense reference on the tokens predicted from a real one (the batch of `_batch`: left, right and
    whole-row padding). The first real token of a left-padded row is predicted from a padding position, whose
    hidden state differs by design (zeros vs the uniform average), so it is left out, as every loss mask does."""
    from llds_jax.rl.logprobs import model_token_logp

    dense = Transformer(ModelConfig.tiny(attention="xla"), rngs=nnx.Rngs(0))
    splash = Transformer(ModelConfig.tiny(attention="splash"), rngs=nnx.Rngs(0))
    tokens, mask = _batch()
    predicted = mask * jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))

    def loss(model):
        logp, _ = model_token_logp(model, tokens, mask)
        return -jnp.sum(logp * predicted) / jnp.sum(predicted), logp

    grad = nnx.jit(nnx.grad(loss, has_aux=True))
    (want, want_logp), (got, got_logp) = grad(dense), grad(splash)
    real = np.asarray(predicted, bool)
    np.testing.assert_allclose(np.asarray(got_logp)[real], np.asarray(want_logp)[real], atol=1e-5, rtol=0)
    for (path, g), (_, r) in zip(nnx.to_flat_state(nnx.state(got)), nnx.to_flat_state(nnx.state(want))):
        g, r = np.asarray(g.get_value()), np.asarray(r.get_value())
        assert np.abs(g - r).max() <= 1e-5 * max(np.abs(r).max(), 1e-6), path


def test_sharded_splash_update_equals_unsharded_dense():
    """On a (data 2, fsdp 2, tensor 2) mesh of fake CPU devices the splash kernel runs per shard (rows over
    data x fsdp, the 2 key/value heads over tensor): the loss gradient equals the unsharded dense one."""
    dense = Transformer(ModelConfig.tiny(attention="xla"), rngs=nnx.Rngs(0))
    splash = Transformer(ModelConfig.tiny(attention="splash"), rngs=nnx.Rngs(0))
    tokens, mask = _batch()
    tokens, mask = jnp.concatenate([tokens, tokens[:1]]), jnp.concatenate([mask, mask[1:2]])  # 4 rows
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    splash = shard_model(splash, mesh)

    def loss(model, tokens, mask):  # tokens predicted from a real one (see the test above)
        logp = jax.nn.log_softmax(model(tokens, mask)[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        predicted = mask[:, 1:] * mask[:, :-1]
        return -jnp.sum(picked * predicted) / jnp.sum(predicted)

    grad = nnx.jit(nnx.value_and_grad(loss))
    want_loss, want = grad(dense, tokens, mask)
    with jax.set_mesh(mesh):
        batch = jax.device_put((tokens, mask), parallel.batch_sharding(mesh, 2))
        got_loss, got = grad(splash, *batch)
        assert "shard_map" in str(jax.make_jaxpr(lambda t, m: nnx.merge(*nnx.split(splash))(t, m))(*batch))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for (path, g), (_, r) in zip(nnx.to_flat_state(nnx.state(got)), nnx.to_flat_state(nnx.state(want))):
        g, r = np.asarray(g.get_value()), np.asarray(r.get_value())
        assert np.abs(g - r).max() <= 1e-5 * max(np.abs(r).max(), 1e-6), path
