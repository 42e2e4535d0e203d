"""PromptIterator: deterministic epoch order, exact resume, per-host slices."""
import itertools
import json

import numpy as np
import pytest

from llds_jax.data.iterator import PromptIterator


def uids(batch):
    return [ex.uid for ex in batch]


def take(iterator, k):
    return [uids(b) for b in itertools.islice(iterator, k)]


def test_order_is_the_seeded_permutation_of_each_epoch(make_examples):
    examples = make_examples(10)
    batches = take(PromptIterator(examples, batch_size=5, seed=7), 4)
    stream = [u for b in batches for u in b]
    expected = [f"nq-{i}" for e in (0, 1) for i in np.random.default_rng([7, e]).permutation(10)]
    assert stream == expected


def test_epochs_cover_all_examples_in_different_orders(make_examples):
    examples = make_examples(12)
    it = PromptIterator(examples, batch_size=4, seed=0)
    epochs = [[u for b in take(it, 3) for u in b] for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(ex.uid for ex in examples)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert it.state()["epoch"] == 3 and it.state()["position"] == 0


def test_batches_wrap_across_epochs_without_dropping(make_examples):
    it = PromptIterator(make_examples(10), batch_size=4, seed=1)
    stream = [u for b in take(it, 5) for u in b]  # 20 items = exactly two epochs
    assert sorted(stream[:10]) == sorted(stream[10:]) == sorted(f"nq-{i}" for i in range(10))
    assert (it.epoch, it.position) == (2, 0)
    next(it)
    assert (it.epoch, it.position) == (2, 4)


def test_restore_continues_with_the_exact_next_batch(make_examples):
    examples = make_examples(10)
    uninterrupted = take(PromptIterator(examples, batch_size=4, seed=3), 9)
    first = PromptIterator(examples, batch_size=4, seed=3)
    assert take(first, 4) == uninterrupted[:4]
    state = json.loads(json.dumps(first.state()))  # as it comes back from the checkpoint's JSON item
    assert state["epoch"] == 1 and state["position"] == 6
    resumed = PromptIterator(examples, batch_size=4, seed=3)
    resumed.restore(state)
    assert take(resumed, 5) == uninterrupted[4:]


def test_resume_with_another_batch_size_continues_the_stream(make_examples):
    examples = make_examples(10)
    stream = [u for b in take(PromptIterator(examples, batch_size=2, seed=5), 12) for u in b]
    first = PromptIterator(examples, batch_size=3, seed=5)
    take(first, 3)
    resumed = PromptIterator(examples, batch_size=5, seed=5)
    resumed.restore(first.state())
    assert [u for b in take(resumed, 3) for u in b] == stream[9:24]


@pytest.mark.parametrize("hosts", [2, 4])
def test_host_slices_partition_each_global_batch(make_examples, hosts):
    examples = make_examples(10)
    global_batches = take(PromptIterator(examples, batch_size=8, seed=2), 5)
    per_host = [take(PromptIterator(examples, batch_size=8, seed=2, process_index=p, process_count=hosts), 5)
                for p in range(hosts)]
    for i, global_batch in enumerate(global_batches):
        slices = [per_host[p][i] for p in range(hosts)]
        assert all(len(s) == 8 // hosts for s in slices)
        assert [u for s in slices for u in s] == global_batch


def test_restore_rejects_other_data_or_seed(make_examples):
    state = PromptIterator(make_examples(10), batch_size=4, seed=3).state()
    with pytest.raises(ValueError, match="'seed' was 3"):
        PromptIterator(make_examples(10), batch_size=4, seed=4).restore(state)
    with pytest.raises(ValueError, match="'num_examples' was 10"):
        PromptIterator(make_examples(11), batch_size=4, seed=3).restore(state)
    changed = make_examples(10)
    changed[4] = changed[4].__class__(uid="nq-4", question="another?", golden_answers=("x",), data_source="nq")
    with pytest.raises(ValueError, match="'fingerprint'"):
        PromptIterator(changed, batch_size=4, seed=3).restore(state)
    with pytest.raises(ValueError, match="missing keys \\['position'\\]"):
        PromptIterator(make_examples(10), batch_size=4, seed=3).restore(
            {k: v for k, v in state.items() if k != "position"})
    with pytest.raises(ValueError, match="'position' must be an int in \\[0, 10\\)"):
        PromptIterator(make_examples(10), batch_size=4, seed=3).restore({**state, "position": 10})


def test_invalid_arguments(make_examples):
    with pytest.raises(ValueError, match="batch_size 6 is not divisible by the 4 hosts"):
        PromptIterator(make_examples(10), batch_size=6, seed=0, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index 2 is not in \\[0, 2\\)"):
        PromptIterator(make_examples(10), batch_size=4, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="no examples"):
        PromptIterator([], batch_size=4, seed=0)
