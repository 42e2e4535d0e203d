"""Deterministic, resumable prompt batches over a list of QA examples, sharded across hosts.

Order: the examples form one endless stream, epoch after epoch; epoch `e` is the permutation
`numpy.random.default_rng([seed, e]).permutation(n)` of the `n` examples. Global batch `i` is stream items
`[i * B, (i + 1) * B)`: a batch that reaches the end of an epoch wraps into the next one, so nothing is dropped and
every example appears exactly once per epoch (a batch larger than the data set holds repeats).

Hosts: every host walks the same global stream; host `p` of `P` yields rows `[p * B / P, (p + 1) * B / P)` of each
global batch, so the hosts' slices partition it.

Resume: `state()` is a small JSON-able dict (`epoch`, `position` = examples of that epoch already yielded, plus the
seed and a fingerprint of the data to catch a changed file); `restore(state)` continues with the exact next batch.
The position counts examples, not batches, so a run may resume with another batch size or host count.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from llds_jax.data.qa import QAExample

STATE_KEYS = ("seed", "epoch", "position", "num_examples", "fingerprint")


def fingerprint(examples: Sequence[QAExample]) -> str:
    """First 16 hex digits of a SHA-256 over the examples' uids and questions, in file order."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(ex.uid.encode("utf-8") + b"\0" + ex.question.encode("utf-8") + b"\0")
    return digest.hexdigest()[:16]


class PromptIterator(Iterator[list[QAExample]]):
    """Endless iterator of this host's share of each global batch of prompts.

    Args:
      examples: the training questions (e.g. `read_qa(path)`), in file order.
      batch_size: prompts per global batch (all hosts together); a multiple of `process_count`.
      seed: decides every epoch's order.
      process_index, process_count: this host and the number of hosts (`jax.process_index()`,
        `jax.process_count()`); each host gets `batch_size // process_count` prompts per batch.
    """

    def __init__(self, examples: Sequence[QAExample], batch_size: int, seed: int,
                 process_index: int = 0, process_count: int = 1):
        if not examples:
            raise ValueError("PromptIterator: no examples")
        if batch_size <= 0:
            raise ValueError(f"PromptIterator: batch_size must be positive, got {batch_size}")
        if process_count <= 0 or not 0 <= process_index < process_count:
            raise ValueError(f"PromptIterator: process_index {process_index} is not in [0, {process_count})")
        if batch_size % process_count:
            raise ValueError(f"PromptIterator: batch_size {batch_size} is not divisible by the "
                             f"{process_count} hosts")
        self._examples = list(examples)
        self._fingerprint = fingerprint(self._examples)
        self.batch_size = batch_size
        self.seed = seed
        self._per_host = batch_size // process_count
        self._offset = process_index * self._per_host
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._examples))

    def __next__(self) -> list[QAExample]:
        indices = []
        for _ in range(self.batch_size):
            indices.append(self._order[self.position])
            self.position += 1
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        return [self._examples[i] for i in indices[self._offset:self._offset + self._per_host]]

    def state(self) -> dict[str, Any]:
        """The position after the last batch yielded: `{seed, epoch, position, num_examples, fingerprint}`."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "num_examples": len(self._examples), "fingerprint": self._fingerprint}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues after the batch at which `state` was taken (`check` first)."""
        self.epoch, self.position = self.check(state)
        self._order = self._permutation(self.epoch)

    def check(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """(epoch, position) of a saved `state`, unchanged iterator; raises ValueError naming the key when `state`
        is incomplete, out of range or was saved for another seed or other data."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"data iterator state: missing keys {missing}")
        expected = {"seed": self.seed, "num_examples": len(self._examples), "fingerprint": self._fingerprint}
        for key, value in expected.items():
            if state[key] != value:
                raise ValueError(f"data iterator state: '{key}' was {state[key]!r} when saved, this iterator has "
                                 f"{value!r} (different data or seed)")
        epoch, position = state["epoch"], state["position"]
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ValueError(f"data iterator state: 'epoch' must be a non-negative int, got {epoch!r}")
        if not (isinstance(position, int) and 0 <= position < len(self._examples)):
            raise ValueError(f"data iterator state: 'position' must be an int in [0, {len(self._examples)}), "
                             f"got {position!r}")
        return epoch, position
