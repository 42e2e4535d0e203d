"""The trainer's choice of training batch length: padded to the bucket, reusing a compiled length that fits."""
import types

import numpy as np

from llds_jax.train.batching import padded_length, training_length


def trajectory(*lengths):
    """A stand-in trajectory whose segments have `lengths` tokens."""
    return types.SimpleNamespace(segments=tuple(types.SimpleNamespace(tokens=np.zeros(n, np.int32))
                                                for n in lengths))


def test_padded_length_rounds_the_longest_trajectory_up_to_the_bucket():
    trajectories = [trajectory(n) for n in (70, 129, 12)]
    assert padded_length(trajectories, 64) == 192
    assert padded_length(trajectories[:1], 64) == 128
    assert padded_length(trajectories[2:], 64) == 64
    assert padded_length([trajectory(128)], 64) == 128
    assert padded_length([trajectory(70, 60), trajectory(129)], 64) == 192  # a row holds all its segments
    assert padded_length([trajectory(70, 60, 1)], 64) == 192


def test_training_length_reuses_the_smallest_compiled_length_that_fits():
    assert training_length(128, set()) == 128                # nothing compiled: the batch's own length
    assert training_length(128, {192, 256}) == 192           # a longer compiled length instead of a new one
    assert training_length(192, {128, 192, 256}) == 192
    assert training_length(320, {128, 192, 256}) == 320      # longer than all: a new length
