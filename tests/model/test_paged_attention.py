"""The paged KV cache's layout (token_layout, write_kv) on exact values, and the reference paged attention against the
project's dense attention and JAX's own reference on the same keys and values laid out in shuffled pages, and against
its earlier form (every token's whole page table gathered, dense attention over it) for any tile, batches whose
longest sequence needs fewer pages than the table holds, and lengths at page and block boundaries."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

from llds_jax.model import paged_kv
from llds_jax.model.attention import dense_attention
from llds_jax.model.paged_attention import paged_attention, reference_paged_attention
from tests.bench.loading import load_bench

Z = 4  # tokens per page


def test_token_layout_exact():
    """Three sequences in 10 token slots: a 3-token chunk after 2 cached tokens (pages 5, 1), a decode token at
    index 4 (page 2's first slot), a 2-token prompt (page 0); slots 6.. padding. Entries past num_seqs are junk."""
    cu = jnp.asarray([0, 3, 4, 6, 2], jnp.int32)
    kv_lens = jnp.asarray([5, 5, 2, 9], jnp.int32)
    pages = jnp.asarray([[5, 1, 7], [3, 4, 2], [0, 6, 6], [9, 9, 9]], jnp.int32)
    seq, pos, slot, valid = paged_kv.token_layout(cu, kv_lens, pages, jnp.asarray([3], jnp.int32), 10, Z)
    np.testing.assert_array_equal(seq, [0, 0, 0, 1, 2, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(pos, [2, 3, 4, 4, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(slot, [5 * Z + 2, 5 * Z + 3, 1 * Z + 0, 4 * Z + 0, 0, 1, -1, -1, -1, -1])
    np.testing.assert_array_equal(valid, [True] * 6 + [False] * 4)


def test_write_kv_puts_each_token_in_its_slot_and_drops_padding():
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(3, 6, Z, 4, 5)).astype(np.float32)  # L 3, P 6, K 2, H 5
    k, v = rng.normal(size=(2, 5, 2, 5)).astype(np.float32)
    slots = np.array([7, 22, -1, 0, -1])
    got = np.asarray(jax.jit(paged_kv.write_kv)(jnp.asarray(pool), jnp.int32(2), jnp.asarray(k), jnp.asarray(v),
                                                 jnp.asarray(slots, jnp.int32)))
    want = pool.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            want[2, s // Z, s % Z, 0::2] = k[t]
            want[2, s // Z, s % Z, 1::2] = v[t]
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, pool)


# (cache length, new tokens, shares the first pages of sequence 0): a prompt chunk from 0, a decode token that fills
# all M pages, a chunk continuing a partly filled page, a sequence on sequence 0's first 2 pages (a shared prompt
# prefix) with 3 new tokens, a decode token on a fresh page.
SEQUENCES = [(9, 9, False), (16, 1, False), (11, 5, False), (11, 3, True), (9, 1, False)]
MAX_SEQS, TOKENS, PAGES_PER_SEQ, POOL = 7, 24, 4, 40


def _ragged_case(seed, n, k, h):
    """Keys and values per sequence, laid out in shuffled pages; the batch's queries; the dense layout of both."""
    rng = np.random.default_rng(seed)
    order = iter(rng.permutation(POOL))
    pool = rng.normal(size=(POOL, Z, 2 * k, h)).astype(np.float32)  # unwritten pages hold junk
    table = rng.integers(0, POOL, size=(MAX_SEQS, PAGES_PER_SEQ)).astype(np.int32)  # junk past the used pages
    keys, values = [], []
    for s, (kv_len, _, shared) in enumerate(SEQUENCES):
        kk, vv = (rng.normal(size=(kv_len, k, h)).astype(np.float32) for _ in range(2))
        first = 0
        if shared:
            first = 2
            table[s, :2] = table[0, :2]
            kk[:2 * Z], vv[:2 * Z] = keys[0][:2 * Z], values[0][:2 * Z]
        for m in range(first, -(-kv_len // Z)):
            table[s, m] = next(order)
        for i in range(first * Z, kv_len):
            pool[table[s, i // Z], i % Z, 0::2] = kk[i]
            pool[table[s, i // Z], i % Z, 1::2] = vv[i]
        keys.append(kk)
        values.append(vv)
    q_lens = [q for _, q, _ in SEQUENCES]
    num = len(SEQUENCES)
    cu = np.concatenate([np.cumsum([0] + q_lens), np.full(MAX_SEQS - num, 5)]).astype(np.int32)  # junk past num
    kv_lens = np.concatenate([[kv for kv, _, _ in SEQUENCES], np.full(MAX_SEQS - num, 3)]).astype(np.int32)
    q = rng.normal(size=(TOKENS, n, h)).astype(np.float32)
    ragged = tuple(jnp.asarray(a) for a in (q, pool, kv_lens, table, cu, np.array([num], np.int32)))
    return ragged, keys, values


def _dense(q_tnh, keys, values):
    """The dense attention of each sequence's new queries over its keys (rows padded), as [T_real, N, H]."""
    b, s, t = len(SEQUENCES), max(kv for kv, _, _ in SEQUENCES), max(q for _, q, _ in SEQUENCES)
    n, h = q_tnh.shape[1:]
    k = keys[0].shape[1]
    q_btnh, k_bskh, v_bskh = np.zeros((b, t, n, h), np.float32), np.zeros((b, s, k, h), np.float32), np.zeros(
        (b, s, k, h), np.float32)
    slot_bt, valid_bs = np.full((b, t), -1, np.int32), np.zeros((b, s), bool)
    start = 0
    for row, (kv_len, q_len, _) in enumerate(SEQUENCES):
        q_btnh[row, :q_len] = q_tnh[start:start + q_len]
        k_bskh[row, :kv_len], v_bskh[row, :kv_len] = keys[row], values[row]
        slot_bt[row, :q_len] = kv_len - q_len + np.arange(q_len)
        valid_bs[row, :kv_len] = True
        start += q_len
    out = np.asarray(dense_attention(*(jnp.asarray(a) for a in (q_btnh, k_bskh, v_bskh, slot_bt, valid_bs))))
    return np.concatenate([out[row, :q_len] for row, (_, q_len, _) in enumerate(SEQUENCES)])


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)], ids=["gqa", "mqa", "mha"])
def test_reference_equals_dense_attention_and_jax_reference(heads):
    n, k = heads
    ragged, keys, values = _ragged_case(0, n, k, 8)
    got = np.asarray(jax.jit(paged_attention, static_argnames="implementation")(*ragged, implementation="reference"))
    real = sum(q for _, q, _ in SEQUENCES)
    want = _dense(np.asarray(ragged[0]), keys, values)
    np.testing.assert_allclose(got[:real], want, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(got[real:], 0)  # padding tokens
    jax_ref = np.asarray(rpa.ref_ragged_paged_attention(*ragged, sm_scale=8 ** -0.5))
    np.testing.assert_allclose(got[:real], jax_ref[:real], rtol=0, atol=2e-6)


def test_shapes_are_checked():
    (q, pool, kv_lens, table, cu, num), _, _ = _ragged_case(0, 4, 2, 8)
    with pytest.raises(ValueError, match="cu_q_lens.shape"):
        paged_attention(q, pool, kv_lens, table, cu[:-1], num, implementation="reference")
    with pytest.raises(ValueError, match="implementation must be one of"):
        paged_attention(q, pool, kv_lens, table, cu, num, implementation="splash")


# The reference as it was before it attended in blocks (the oracle): each token gathers all M pages of its sequence
# and runs the dense attention over its cache indices 0 .. position as a batch row of one query (bench/paged_reference.py
# times it against the blocked one).
_gather_everything = load_bench("paged_reference").gather_everything


WIDE_PAGES, WIDE_TOKENS = 7, 16  # a page table of 7 pages (28 slots); 16 token slots


def _random_batch(seed, sequences, n=4, k=2, h=8):
    """sequences: (kv_len, q_len) each. Each sequence's pages drawn from a shuffled pool of random keys and values;
    junk (random pages) in the page table past them, in the batch past num_seqs and in the unused pages."""
    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(POOL, Z, 2 * k, h)).astype(np.float32)
    table = rng.integers(0, POOL, size=(MAX_SEQS, WIDE_PAGES)).astype(np.int32)
    free = iter(rng.permutation(POOL))
    for s, (kv_len, _) in enumerate(sequences):
        for m in range(-(-kv_len // Z)):
            table[s, m] = next(free)
    num = len(sequences)
    cu = np.concatenate([np.cumsum([0] + [q for _, q in sequences]), np.full(MAX_SEQS - num, 5)]).astype(np.int32)
    kv_lens = np.concatenate([[kv for kv, _ in sequences], np.full(MAX_SEQS - num, 3)]).astype(np.int32)
    q = rng.normal(size=(WIDE_TOKENS, n, h)).astype(np.float32)
    return pool, table, tuple(jnp.asarray(a) for a in (q, pool, kv_lens, table, cu, np.array([num], np.int32)))


# Longest sequence 3 pages of the table's 7, kv_lens at page (4, 8, 12) and block (2 pages: 8; 3 pages: 12; 4 pages:
# none reached) boundaries; then the whole table (28 slots) reached, 24 = 2 blocks of 3 pages, 16 = 2 of 2 or 1 of 4.
BATCHES = {"short": [(4, 4), (8, 1), (12, 3), (1, 1), (5, 2)], "full": [(28, 2), (16, 5), (24, 1), (3, 3), (9, 4)]}


@pytest.mark.parametrize("queries_per_block", [None, 3, 16], ids=["q-default", "q3", "q16"])
@pytest.mark.parametrize("kv_pages_per_block", [None, 1, 2, 3, 4, 7], ids=lambda b: f"pages{b}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_blocks_equal_the_whole_page_table(batch, kv_pages_per_block, queries_per_block):
    """Any tile (pages per block dividing the table's 7 or not, query chunks dividing the 16 tokens or not) gives
    what gathering every token's whole page table gave."""
    _, _, ragged = _random_batch(1, BATCHES[batch])
    got = jax.jit(functools.partial(reference_paged_attention, kv_pages_per_block=kv_pages_per_block,
                                    queries_per_block=queries_per_block))(*ragged)
    want = jax.jit(_gather_everything)(*ragged)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)
    real = sum(q for _, q in BATCHES[batch])
    np.testing.assert_array_equal(np.asarray(got)[real:], 0)


def test_blocks_past_the_longest_sequence_are_never_read():
    """With blocks of 2 pages and every sequence within its first 3 pages, the table's pages 4 .. 7 name a page of
    NaNs: the result is finite and equals the oracle's with a finite page there (a loop over every block would
    multiply the NaNs by zero probabilities and return NaN)."""
    pool, table, ragged = _random_batch(2, BATCHES["short"])
    q, _, kv_lens, _, cu, num = ragged
    nan_page = POOL - 1
    assert nan_page not in table[:, :4]  # pages 0 .. 3: the blocks read
    pool[nan_page] = np.nan
    table[:, 4:] = nan_page
    got = np.asarray(jax.jit(functools.partial(reference_paged_attention, kv_pages_per_block=2))(
        q, jnp.asarray(pool), kv_lens, jnp.asarray(table), cu, num))
    table[:, 4:] = 0
    want = np.asarray(jax.jit(_gather_everything)(q, jnp.asarray(pool), kv_lens, jnp.asarray(table), cu, num))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
