"""Host-side bookkeeping of the paged KV cache: which pages of the device pool hold each sequence's tokens.

The device pool (`llds_jax.model.paged_kv`) holds `num_pages` pages of `page_size` token slots in every layer; the
token at context position i of a sequence lives in slot i % page_size of page `pages(seq)[i // page_size]`. Pages
are reference-counted, so sequences share what they have in common instead of holding copies:

  share(seq, source, length)   a GRPO group's samples take their prompt's pages from the sample that encoded it,
                               a tree fork takes its parent's pages up to the node: a page table and nothing else.
  write(seq, end)              readies slots length(seq) .. end - 1 for writing: new pages where the sequence has
                               none, and a private copy of any page it shares (copy on write: at most the one
                               partly filled page a share ended in). Returns the copies the device makes first.
  truncate(seq, length)        the roll back of tokens sampled after a turn's cut: pages past `length` go back.
  free(seq)                    a finished sequence gives every page back; nothing is compacted or copied.

Page 0 is never handed out: it is where the device program writes the slots of padding tokens.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PADDING_PAGE = 0


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a write needs (the scheduler reserves pages so that this never happens
    in a rollout; it is a bug when it does)."""


@dataclasses.dataclass(frozen=True)
class PageCopy:
    """A page the device copies (every layer) before a step writes into the copy: `source` -> `target`."""

    source: int
    target: int


class PageTable:
    """Page tables of the sequences in flight and the pool's reference counts.

    Args:
      num_pages: pages in the device pool (page 0 included, which is never handed out).
      page_size: token slots per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"PageTable: needs at least 2 pages of at least 1 slot, got {num_pages} x {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._refs = [0] * num_pages  # a Python list: the host reads it one page at a time
        self._free = list(range(num_pages - 1, PADDING_PAGE, -1))  # popped from the end: page 1 first
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` slots."""
        return -(-tokens // self.page_size)

    def __contains__(self, seq: int) -> bool:
        return seq in self._pages

    def pages(self, seq: int) -> list[int]:
        """The sequence's page table (a copy)."""
        return list(self._pages[seq])

    def held(self, seq: int) -> int:
        """Pages the sequence holds."""
        return len(self._pages[seq])

    def length(self, seq: int) -> int:
        """Slots the sequence holds (written, or readied by `write`)."""
        return self._lengths[seq]

    def add(self, seq: int) -> None:
        """A new, empty sequence."""
        if seq in self._pages:
            raise ValueError(f"PageTable.add: sequence {seq} is already in flight")
        self._pages[seq], self._lengths[seq] = [], 0

    def share(self, seq: int, source: int, length: int) -> None:
        """A new sequence whose first `length` slots are `source`'s (its pages shared, not copied)."""
        if not 0 <= length <= self._lengths[source]:
            raise ValueError(f"PageTable.share: {length} slots of sequence {source}, which holds "
                             f"{self._lengths[source]}")
        self.add(seq)
        pages = self._pages[source][:self.pages_for(length)]
        for page in pages:
            self._refs[page] += 1
        self._pages[seq], self._lengths[seq] = list(pages), length

    def pages_to_write(self, seq: int, end: int) -> int:
        """Free pages `write(seq, end)` would take (new pages and copies of shared ones)."""
        table, first = self._pages[seq], self._lengths[seq] // self.page_size
        shared = sum(1 for page in table[first:self.pages_for(end)] if self._refs[page] > 1)
        return max(0, self.pages_for(end) - len(table)) + shared

    def write(self, seq: int, end: int) -> list[PageCopy]:
        """Readies slots length(seq) .. end - 1 for writing and makes `end` the sequence's length.

        Raises OutOfPages (changing nothing) when the pool cannot supply the pages. Returns the copies of shared
        pages, to be made on device before the write."""
        start = self._lengths[seq]
        if end < start:
            raise ValueError(f"PageTable.write: sequence {seq} holds {start} slots, asked to end at {end}")
        needed = self.pages_to_write(seq, end)
        if needed > len(self._free):
            raise OutOfPages(f"sequence {seq} needs {needed} pages to hold {end} slots, {len(self._free)} are free")
        table, copies = self._pages[seq], []
        for index in range(start // self.page_size, min(len(table), self.pages_for(end))):
            if self._refs[table[index]] > 1:
                target = self._take()
                copies.append(PageCopy(table[index], target))
                self._refs[table[index]] -= 1
                table[index] = target
        while len(table) < self.pages_for(end):
            table.append(self._take())
        self._lengths[seq] = end
        return copies

    def truncate(self, seq: int, length: int) -> None:
        """Keeps the first `length` slots of the sequence; the pages past them go back to the pool."""
        if not 0 <= length <= self._lengths[seq]:
            raise ValueError(f"PageTable.truncate: sequence {seq} holds {self._lengths[seq]} slots, not {length}")
        table = self._pages[seq]
        keep = self.pages_for(length)
        self._release(table[keep:])
        del table[keep:]
        self._lengths[seq] = length

    def free(self, seq: int) -> None:
        """The sequence is finished: every page it holds goes back (a shared page when its last holder goes)."""
        self._release(self._pages.pop(seq))
        del self._lengths[seq]

    def table_array(self, seqs: list[int], pages_per_sequence: int) -> np.ndarray:
        """int32 [len(seqs), pages_per_sequence]: each sequence's pages, padded with PADDING_PAGE."""
        out = np.full((len(seqs), pages_per_sequence), PADDING_PAGE, np.int32)
        for row, seq in enumerate(seqs):
            pages = self._pages[seq]
            if len(pages) > pages_per_sequence:
                raise ValueError(f"PageTable.table_array: sequence {seq} holds {len(pages)} pages, more than "
                                 f"{pages_per_sequence}")
            out[row, :len(pages)] = pages
        return out

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, pages: list[int]) -> None:
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
