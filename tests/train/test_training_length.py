"""The trainer's choice of training batch length: padded to the bucket, reusing a compiled length that fits."""
import types

import numpy as np

from llds_jax.train.batching import padded_length, training_length


def test_padded_length_rounds_the_longest_trajectory_up_to_the_bucket():
    trajectories = [types.SimpleNamespace(tokens=np.zeros(n, np.int32)) for n in (70, 129, 12)]
    assert padded_length(trajectories, 64) == 192
    assert padded_length(trajectories[:1], 64) == 128
    assert padded_length(trajectories[2:], 64) == 64
    assert padded_length([types.SimpleNamespace(tokens=np.zeros(128, np.int32))], 64) == 128


def test_training_length_reuses_the_smallest_compiled_length_that_fits():
    assert training_length(128, set()) == 128                # nothing compiled: the batch's own length
    assert training_length(128, {192, 256}) == 192           # a longer compiled length instead of a new one
    assert training_length(192, {128, 192, 256}) == 192
    assert training_length(320, {128, 192, 256}) == 320      # longer than all: a new length
