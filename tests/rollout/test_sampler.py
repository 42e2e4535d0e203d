"""The sampler: sampling distributions, and sessions over the KV cache checked against full forwards."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import ModelConfig, Transformer
from llds_jax.programs import Role
from llds_jax.rollout import buckets
from llds_jax.rollout.config import SamplingConfig
from llds_jax.rollout.kernels import sample_tokens
from llds_jax.rollout.sampler import Sampler, SessionShapes
from llds_jax.rollout.shape_plan import PrefillShape

TEMPERATURE = 0.7


def draw(logits_v, cfg, n=4000):
    """n samples (tokens, log-probs) of one row of logits, each with its own key."""
    logits_nv = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (n, len(logits_v)))
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logps = jax.jit(lambda l, k: sample_tokens(l, k, cfg))(logits_nv, keys)
    return np.asarray(tokens), np.asarray(logps)


LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def frequencies(tokens, v=len(LOGITS)):
    return np.bincount(tokens, minlength=v) / len(tokens)


def test_temperature_sampling_matches_distribution_and_logp():
    tokens, logps = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE))
    expected_logp = jax.nn.log_softmax(LOGITS / TEMPERATURE)
    np.testing.assert_allclose(logps, np.asarray(expected_logp)[tokens], atol=1e-6)
    np.testing.assert_allclose(frequencies(tokens), np.exp(expected_logp), atol=0.03)


def test_top_k_and_top_p_restrict_candidates_but_not_logp():
    full_logp = np.asarray(jax.nn.log_softmax(LOGITS / TEMPERATURE))
    probs = np.exp(full_logp)
    tokens, logps = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_k=3))
    assert set(tokens) == {0, 1, 2}
    np.testing.assert_allclose(frequencies(tokens)[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    np.testing.assert_allclose(logps, full_logp[tokens], atol=1e-6)  # full-vocabulary log-probs
    # top_p: the smallest prefix of sorted tokens whose mass reaches p.
    p = probs[:2].sum() + 0.5 * probs[2]
    tokens, _ = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_p=float(p)))
    assert set(tokens) == {0, 1, 2}
    np.testing.assert_allclose(frequencies(tokens)[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    tokens, _ = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_p=float(probs[0] * 0.5)))
    assert set(tokens) == {0}
    tokens, _ = draw(LOGITS, SamplingConfig(temperature=TEMPERATURE, top_k=4, top_p=float(p)))
    assert set(tokens) == {0, 1, 2}


def test_greedy_takes_argmax_with_temperature_one_logp():
    logits = np.array([0.1, 3.0, -1.0, 2.9])
    tokens, logps = draw(logits, SamplingConfig(greedy=True, temperature=0.5), n=4)
    assert (tokens == 1).all()
    np.testing.assert_allclose(logps, np.asarray(jax.nn.log_softmax(logits))[1], atol=1e-6)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="rollout.temperature"):
        SamplingConfig(temperature=0.0)
    with pytest.raises(ValueError, match="rollout.top_p"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match="rollout.decode_chunk"):
        SamplingConfig(decode_chunk=0)


def test_buckets():
    assert [buckets.pow2_bucket(n, 16) for n in (0, 1, 16, 17, 200)] == [16, 16, 16, 32, 256]
    assert buckets.batch_bucket(3, multiple=4) == 4 and buckets.batch_bucket(5, multiple=4) == 8
    assert buckets.batch_bucket(3, multiple=6) == 6


# One sampler (and so one set of compiled programs) shared by the tests that use this config.
CONFIG = SamplingConfig(temperature=TEMPERATURE, decode_chunk=4, min_capacity_bucket=16, min_observation_bucket=4)


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    return model, graphdef, params


@pytest.fixture(scope="module")
def sampler(tiny):
    return Sampler(tiny[1], CONFIG)


def prompts_of(lengths, seed=0):
    rs = np.random.RandomState(seed)
    return [rs.randint(10, 250, size=n).tolist() for n in lengths]


def converse(session, prompts, turns, budgets, keep_fn, obs_fn, finished=None):
    """Drives a session; returns per sequence the full token list, a model-token mask and sampler log-probs."""
    n = len(prompts)
    seqs = [list(p) for p in prompts]
    mask = [[0] * len(p) for p in prompts]
    logps = [[0.0] * len(p) for p in prompts]
    alive = [True] * n
    sampled = []
    for turn in range(turns):
        out = session.decode_turn([b if a else 0 for b, a in zip(budgets(turn), alive)],
                                  finished or (lambda toks: [False] * len(toks)))
        sampled.append(out)
        keep = [keep_fn(turn, i, o) if alive[i] else 0 for i, o in enumerate(out)]
        obs = [obs_fn(turn, i) if alive[i] else None for i in range(n)]
        for i in range(n):
            if not alive[i]:
                continue
            k = keep[i]
            seqs[i] += out[i].token_ids[:k]
            mask[i] += [1] * k
            logps[i] += out[i].logps[:k]
            if obs[i] is None:
                alive[i] = False
            else:
                seqs[i] += obs[i]
                mask[i] += [0] * len(obs[i])
                logps[i] += [0.0] * len(obs[i])
        session.end_turn(keep, obs)
    return seqs, mask, logps, sampled


def full_forward_logps(model, seqs, temperature):
    """log p(token t | tokens < t) from one full forward, log_softmax(logits / T), each sequence right-padded."""
    length = buckets.pow2_bucket(max(map(len, seqs)), 64)
    tokens = np.zeros((len(seqs), length), np.int32)
    valid = np.zeros((len(seqs), length), np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, :len(seq)], valid[i, :len(seq)] = seq, 1
    graphdef, params = nnx.split(model)

    @jax.jit
    def logps(params, tokens, valid):
        logits = nnx.merge(graphdef, params)(tokens, valid) / temperature
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=2)[..., 0]

    out = np.asarray(logps(params, tokens, valid))
    return [out[i, :len(seq) - 1] for i, seq in enumerate(seqs)]


def check_logps(model, seqs, mask, logps, temperature=TEMPERATURE):
    """Sampler log-probs equal a full forward's log_softmax(logits / T) over each final sequence."""
    for ref, m, lp in zip(full_forward_logps(model, seqs, temperature), mask, logps):
        is_model = np.asarray(m[1:], bool)
        assert is_model.sum() > 0
        np.testing.assert_allclose(np.asarray(lp[1:])[is_model], ref[is_model], atol=1e-4)


@pytest.mark.slow
def test_multi_turn_rollback_and_extend_match_full_forward(tiny, sampler):
    """Turns are cut at arbitrary points (later tokens rolled back), observations appended with extend, the
    cache grows past its first bucket, and finished rows leave the batch (compaction)."""
    model, _, params = tiny
    prompts = prompts_of([3, 7, 12, 5])
    session = sampler.start(params, prompts, jax.random.key(1))
    rs = np.random.RandomState(1)
    obs_lens = {(t, i): 1 + rs.randint(6) for t in range(3) for i in range(4)}
    capacities, rows = [], []

    def obs_fn(turn, i):
        if turn == 0 and i == 3 or turn == 1 and i == 2:
            return None  # finished: leaves the batch
        return rs.randint(10, 250, size=obs_lens[turn, i]).tolist()

    def keep_fn(turn, i, out):
        capacities.append(session.capacity)
        rows.append(session.batch_rows)
        return max(0, len(out.token_ids) - 1 - 3 * ((i + turn) % 3))  # roll back 1, 4 or 7 tokens

    # Rows stop at 5+ tokens (checked between chunks of 4), so they overshoot to 8 and get rolled back.
    seqs, mask, logps, sampled = converse(session, prompts, 3, lambda t: [9, 6, 11, 10], keep_fn, obs_fn,
                                          finished=lambda toks: [len(t) >= 5 for t in toks])
    assert [len(o.token_ids) for o in sampled[0]] == [8, 6, 8, 8]
    assert max(capacities) > min(capacities) == 32  # grew past the first bucket
    assert rows[0] == 4 and rows[-1] == 2  # compacted after two sequences finished
    cache = session._state.cache  # no valid slot at or past a row's end: rolled-back tokens are gone
    assert not any(np.asarray(cache.valid_bs)[b, e:].any() for b, e in enumerate(np.asarray(cache.end_b)))
    check_logps(model, seqs, mask, logps)


def test_stop_tokens_end_the_turn(tiny):
    model, graphdef, params = tiny
    stop_ids = tuple(range(0, 256, 5))
    sampler = Sampler(graphdef, SamplingConfig(temperature=1.5, decode_chunk=8, stop_ids=stop_ids))
    prompts = prompts_of([4, 9, 6])
    session = sampler.start(params, prompts, jax.random.key(3))
    seqs, mask, logps, sampled = converse(
        session, prompts, 2, lambda t: [40, 40, 40],
        lambda t, i, out: len(out.token_ids) - out.hit_stop,  # the stop token is not kept
        lambda t, i: [11, 12, 13])
    hits = 0
    for turn in sampled:
        for out in turn:
            stops = [k for k, tok in enumerate(out.token_ids) if tok in stop_ids]
            assert out.hit_stop == bool(stops)
            if stops:
                assert stops == [len(out.token_ids) - 1]
                hits += 1
            else:
                assert len(out.token_ids) == 40
    assert hits >= 3
    check_logps(model, seqs, mask, logps, temperature=1.5)


def test_rows_do_not_depend_on_batch_mates_and_seed_matters(tiny, sampler):
    _, _, params = tiny
    prompts = prompts_of([5, 11, 3])
    turn = lambda ps, key: sampler.start(params, ps, key).decode_turn([12] * len(ps), lambda t: [False] * len(t))
    three = turn(prompts, jax.random.key(7))
    two = turn(prompts[:2], jax.random.key(7))  # a smaller batch bucket
    assert [o.token_ids for o in two] == [o.token_ids for o in three[:2]]
    np.testing.assert_allclose([o.logps for o in two], [o.logps for o in three[:2]], atol=1e-5)
    other = turn(prompts, jax.random.key(8))
    assert [o.token_ids for o in other] != [o.token_ids for o in three]


@pytest.mark.slow
def test_sharded_session_matches_unsharded(tiny, sampler):
    model, graphdef, params = tiny
    prompts = prompts_of([6, 2, 9, 4, 7])
    obs = lambda t, i: [20 + i, 30 + t]
    keep = lambda t, i, out: len(out.token_ids) - 2
    ref = converse(sampler.start(params, prompts, jax.random.key(5)), prompts, 2,
                   lambda t: [7] * 5, keep, obs)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    sharded_params = jax.device_put(params, parallel.param_shardings(params, mesh))
    session = Sampler(graphdef, CONFIG, mesh=mesh).start(sharded_params, prompts, jax.random.key(5))
    got = converse(session, prompts, 2, lambda t: [7] * 5, keep, obs)
    assert session.batch_rows == 8  # 5 rows bucketed to a multiple of data x fsdp = 4
    assert got[0] == ref[0]
    np.testing.assert_allclose(np.concatenate(got[2]), np.concatenate(ref[2]), atol=1e-4)
    check_logps(model, *got[:3])


def test_sampling_on_a_mesh_sees_each_rows_whole_vocabulary(tiny):
    """The decode chunk on a mesh samples from logits gathered over the vocabulary (split by rows only): left split
    over the tensor axis, XLA's CPU compiler turned the inverse-CDF draw's cumsum into a reduce-window over the whole
    vocabulary per output element (O(V^2) per row: 143x slower at Qwen's 151,936, bench/mesh_decode.py)."""
    _, graphdef, params = tiny
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    sampler = Sampler(graphdef, dataclasses.replace(CONFIG, greedy=False, top_p=1.0, temperature=1.0), mesh=mesh)
    at = SessionShapes(parallel.abstract_params(params, mesh), rows=4, prompt=8, prefill_capacity=16, capacity=16,
                       observation=8)
    [decode] = [p for p in sampler.abstract_programs(at) if p.role is Role.DECODE_CHUNK]
    hlo = decode.lower().compile().as_text()
    windows = [[int(n) for n in w.split("x")] for w in re.findall(r"reduce-window\(.*window=\{size=([0-9x]+)", hlo)]
    assert windows, "no reduce-window at all: the check below cannot bite"
    vocab = ModelConfig.tiny().vocab_size
    assert all(max(w) < vocab for w in windows), windows


def test_nucleus_sampling_decodes_without_a_sort(tiny, sampler):
    """The decode chunk with top_p < 1 and no top_k (the sampler's config: top_p 0.95) compiles to a program without
    a sort; with top_k = the whole vocabulary (the sorted nucleus the sampler ran before, llds_jax.rollout.nucleus)
    the same search finds one."""
    _, graphdef, params = tiny
    at = SessionShapes(params, rows=4, prompt=8, prefill_capacity=16, capacity=16, observation=8)
    sorted_sampler = Sampler(graphdef, dataclasses.replace(CONFIG, top_k=ModelConfig.tiny().vocab_size))
    sorts = []
    for s in (sampler, sorted_sampler):
        assert s.config.top_p < 1
        [decode] = [p for p in s.abstract_programs(at) if p.role is Role.DECODE_CHUNK]
        sorts.append(len(re.findall(r"\bsort\(", decode.lower().compile().as_text())))
    assert sorts[0] == 0 and sorts[1] > 0, sorts


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "mesh"])
def test_frozen_shapes_compile_the_bucket_grid_ahead_and_sample_the_same(tiny, backend_compiles, sharded):
    """freeze_shapes compiles the grid of the buckets run so far; then a conversation that needs shapes no session
    ran (shorter observations; a compaction to 2 rows at capacity 32, where the first only compacted at 64)
    compiles nothing, and samples exactly what a fresh sampler samples."""
    model, graphdef, params = tiny
    mesh = parallel.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4]) if sharded else None
    if sharded:
        params = jax.device_put(params, parallel.param_shardings(params, mesh))
    prompts = prompts_of([3, 7, 12, 5])
    keep = lambda t, i, out: len(out.token_ids) - 1

    def conversation(sampler, obs_len, leaves, seed):
        obs = lambda t, i: None if (t, i) in leaves else list(range(20 + i, 20 + i + obs_len))
        return converse(sampler.start(params, prompts, jax.random.key(seed)), prompts, 3,
                        lambda t: [6, 6, 6, 6], keep, obs)

    sampler = Sampler(graphdef, CONFIG, mesh=mesh)
    # Prompt bucket 16, capacity 32; the first extend fits (observation bucket 8), the second turn grows the cache
    # to 64; 2 rows are left for the third turn: it compacts 4 -> 2 rows at capacity 64.
    conversation(sampler, obs_len=7, leaves={(0, 3), (1, 2)}, seed=0)
    # The grid of rows {4, 2} x capacities {32, 64}: missing were compaction 4 -> 2 at 32, and decode, the extend
    # and growth to 64 of 2 rows at 32.
    assert sampler.freeze_shapes() == 4
    assert sampler.freeze_shapes() == 0
    # Observations of 3 tokens and 2 rows left after the first turn: compaction to 2 rows at capacity 32.
    leaves = {(0, 3), (0, 2), (1, 1)}
    select, compactions = sampler.select_rows, []  # (capacity, rows after) of each compaction
    sampler.select_rows = lambda state, rows_b: compactions.append((state.cache.capacity, len(rows_b))) or select(
        state, rows_b)
    with backend_compiles() as compiles:
        got = conversation(sampler, obs_len=3, leaves=leaves, seed=1)
    assert compiles == []
    assert compactions == [(32, 2)]  # a program of the grid (without it the batch would stay at 4 rows)
    fresh = Sampler(graphdef, CONFIG, mesh=mesh)
    with backend_compiles() as compiles:
        ref = conversation(fresh, obs_len=3, leaves=leaves, seed=1)
    assert len(compiles) > 0
    assert got[0] == ref[0]
    np.testing.assert_allclose(np.concatenate(got[2]), np.concatenate(ref[2]), atol=1e-5)
    check_logps(model, *got[:3])


def test_frozen_session_reuses_a_longer_prompt_bucket(tiny, backend_compiles):
    """Shorter prompts than any before go into the prompt bucket already compiled (left padding is masked), and
    sample exactly what a fresh sampler samples with their own smaller bucket."""
    model, graphdef, params = tiny
    obs = lambda t, i: [20 + i, 30 + t]
    keep = lambda t, i, out: len(out.token_ids)

    def conversation(sampler, prompts, seed):
        return converse(sampler.start(params, prompts, jax.random.key(seed)), prompts, 2, lambda t: [5, 5], keep,
                        obs)

    sampler = Sampler(graphdef, CONFIG)
    conversation(sampler, prompts_of([20, 3]), seed=0)  # prompt bucket 32
    sampler.freeze_shapes(grid=False)
    short = prompts_of([9, 4], seed=1)  # bucket 16 on its own
    with backend_compiles() as compiles:
        got = conversation(sampler, short, seed=1)
    assert compiles == []
    ref = conversation(Sampler(graphdef, CONFIG), short, seed=1)
    assert got[0] == ref[0]
    np.testing.assert_allclose(np.concatenate(got[2]), np.concatenate(ref[2]), atol=1e-5)


def test_abstract_programs_are_a_sessions_at_one_set_of_buckets(tiny, sampler):
    """What --mode=compile lowers (`abstract_programs`): a session's programs at one set of buckets, named with
    their shapes; for a continuous batch the empty batch, the prompt extend and the row extend in place of the
    prefill and the extend. Each lowers to the program a session runs at those shapes."""
    at = SessionShapes(tiny[2], rows=4, prompt=16, prefill_capacity=32, capacity=64, observation=8)
    programs = sampler.abstract_programs(at)
    assert [(p.name, p.shapes) for p in programs] == [
        ("prefill", "4 x 16 tokens, 32 slots"), ("decode chunk", "4 rows x 4 steps, 64 slots"),
        ("extend", "4 x 8 tokens, 64 slots"), ("cache growth", "4 rows, 32 -> 64 slots"),
        ("compaction", "4 -> 2 rows, 64 slots")]
    continuous = sampler.abstract_programs(dataclasses.replace(at, continuous=True))
    assert [p.name for p in continuous] == ["empty batch", "prompt extend", "decode chunk", "row extend",
                                            "cache growth", "compaction"]
    grown = programs[3].lower().out_info
    assert grown.cache.valid_bs.shape == (4, 64) and programs[3].args[0].cache.valid_bs.shape == (4, 32)


def test_shared_prompt_prefill_encodes_each_prompt_once_and_samples_what_every_row_encoded_would(tiny, sampler):
    """`shared_prompt_prefill`: a batch of GRPO groups (each prompt repeated, a group cut by the batch's end)
    encodes its 4 distinct prompts at a 4-row bucket instead of 16 rows, and over two turns with observations its
    rows sample the tokens, with the log-probs, that a prefill of every row gives."""
    model, graphdef, params = tiny
    prompts = [p for p in prompts_of([5, 9, 3, 7]) for _ in range(3)][:11]  # 4 groups of 3, the last cut to 2
    obs = lambda t, i: [20 + i, 30 + t]
    keep = lambda t, i, out: len(out.token_ids) - 1
    ref = converse(sampler.start(params, prompts, jax.random.key(4)), prompts, 2, lambda t: [6] * 11, keep, obs)
    shared = Sampler(graphdef, dataclasses.replace(CONFIG, shared_prompt_prefill=True))
    got = converse(shared.start(params, prompts, jax.random.key(4)), prompts, 2, lambda t: [6] * 11, keep, obs)
    assert shared.plan.has_run(PrefillShape(16, 16, 32, 4))  # 11 rows bucketed to 16, their 4 prompts to 4
    assert not shared.plan.has_run(PrefillShape(16, 16, 32))
    assert got[0] == ref[0]
    np.testing.assert_allclose(np.concatenate(got[2]), np.concatenate(ref[2]), atol=1e-5)
    check_logps(model, *got[:3])
    flops = [p.lower().compile().cost_analysis()["flops"] for p in (
        sampler.abstract_programs(SessionShapes(params, 16, 16, 32, 64, 8))[0],
        shared.abstract_programs(SessionShapes(params, 16, 16, 32, 64, 8, distinct=4))[0])]
    assert flops[1] < 0.3 * flops[0]  # the forward at 4 rows instead of 16


def test_shared_prompt_prefill_of_distinct_prompts_is_the_plain_prefill(tiny):
    """Where no prompt repeats (evaluation, n = 1), the shared prefill's bucket is the batch's: the plain program
    runs."""
    _, graphdef, params = tiny
    shared = Sampler(graphdef, dataclasses.replace(CONFIG, shared_prompt_prefill=True))
    shared.start(params, prompts_of([4, 6, 5]), jax.random.key(0)).decode_turn([3] * 3, lambda t: [False] * len(t))
    assert shared.plan.has_run(PrefillShape(4, 16, 32))
