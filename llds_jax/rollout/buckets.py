"""Shape buckets: sizes rounded up so that a run compiles a bounded set of programs (training batch lengths, the
warm start's sequence buckets)."""
from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` >= n (n >= 0, multiple >= 1)."""
    return -(-n // multiple) * multiple
