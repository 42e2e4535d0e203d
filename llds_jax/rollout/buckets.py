"""Shape buckets: sizes rounded up so that a run compiles a bounded set of programs.

Every shape the rollout engine hands to a jitted function (batch rows, prompt length, cache slots, observation
length) goes through one of these, so a run of any length compiles at most O(log(max size)) variants of each.
"""
from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` >= n (n >= 0, multiple >= 1)."""
    return -(-n // multiple) * multiple


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    if n < 0 or minimum < 1:
        raise ValueError(f"pow2_bucket: need n >= 0 and minimum >= 1, got n={n}, minimum={minimum}")
    size = 1
    while size < max(n, minimum):
        size *= 2
    return size


def batch_bucket(n: int, multiple: int = 1, minimum: int = 1) -> int:
    """Rows of a batch of n sequences: a power of two (>= minimum) rounded up to a multiple of `multiple`.

    `multiple` is the number of batch shards of the mesh (data x fsdp), so every shard holds the same rows.
    """
    if multiple < 1:
        raise ValueError(f"batch_bucket: multiple must be >= 1, got {multiple}")
    return round_up(pow2_bucket(n, minimum), multiple)


def compact_bucket(n: int, multiple: int = 1, minimum: int = 1) -> int:
    """Rows of a continuous batch compacted to n live sequences: the smallest of the powers of two and the 1.5x
    steps between them (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) >= max(n, minimum), rounded up to a multiple of
    `multiple` (the mesh's batch shards, as `batch_bucket`). Before the rounding, n rows above `minimum` fill more
    than 2/3 of it (of a power of two: more than 1/2)."""
    if multiple < 1:
        raise ValueError(f"compact_bucket: multiple must be >= 1, got {multiple}")
    size = pow2_bucket(n, minimum)
    if size >= 4 and size // 4 * 3 >= max(n, minimum):
        size = size // 4 * 3
    return round_up(size, multiple)
