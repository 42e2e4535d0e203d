"""The paged cache's host bookkeeping against a simulated device pool: every sequence reads back exactly the tokens
it wrote (or shared), whatever the order of shares, copy-on-write writes, roll backs and frees."""
import numpy as np
import pytest

from llds_jax.rollout.pages import PADDING_PAGE, OutOfPages, PageTable


class Pool:
    """A device pool of token values [pages, page_size] driven by a PageTable as the engine drives the device."""

    def __init__(self, table: PageTable):
        self.table = table
        self.slots = np.full((table.num_pages, table.page_size), -1, np.int64)

    def write(self, seq: int, values: list[int]) -> list:
        start = self.table.length(seq)
        copies = self.table.write(seq, start + len(values))
        for copy in copies:  # copies first, as the step program makes them
            self.slots[copy.target] = self.slots[copy.source]
        pages = self.table.pages(seq)
        for i, value in enumerate(values, start):
            self.slots[pages[i // self.table.page_size], i % self.table.page_size] = value
        return copies

    def read(self, seq: int) -> list[int]:
        pages, size = self.table.pages(seq), self.table.page_size
        return [int(self.slots[pages[i // size], i % size]) for i in range(self.table.length(seq))]


def check_counts(table: PageTable, seqs):
    held = [page for seq in seqs for page in table.pages(seq)]
    assert PADDING_PAGE not in held
    assert table.free_pages == table.num_pages - 1 - len(set(held))
    for page in set(held):
        assert table._refs[page] == held.count(page)


def test_a_group_shares_its_prompts_pages_and_copies_only_the_partly_filled_one_on_write():
    table = PageTable(num_pages=16, page_size=4)
    pool = Pool(table)
    table.add(0)
    pool.write(0, list(range(10)))  # pages: 4 + 4 + 2 slots
    for seq in (1, 2, 3):
        table.share(seq, 0, 9)  # all but the last prompt token, which each sample encodes itself
    assert table.free_pages == 16 - 1 - 3
    assert [table.pages(s) for s in (1, 2, 3)] == [table.pages(0)] * 3
    copies = pool.write(1, [100, 101])
    assert len(copies) == 1 and copies[0].source == table.pages(0)[2]  # one page copied, the full ones shared
    assert table.pages(1)[:2] == table.pages(0)[:2] and table.pages(1)[2] != table.pages(0)[2]
    assert pool.read(1) == list(range(9)) + [100, 101] and pool.read(0) == list(range(10))
    assert pool.read(2) == list(range(9))
    check_counts(table, [0, 1, 2, 3])


def test_a_page_shared_at_a_page_boundary_is_never_copied():
    table = PageTable(num_pages=8, page_size=4)
    pool = Pool(table)
    table.add(0)
    pool.write(0, list(range(8)))
    table.share(1, 0, 8)
    assert pool.write(1, [50]) == [] and pool.write(0, [60]) == []
    assert pool.read(1) == list(range(8)) + [50] and pool.read(0) == list(range(8)) + [60]


def test_the_source_copies_too_when_it_writes_into_a_page_it_shares():
    table = PageTable(num_pages=8, page_size=4)
    pool = Pool(table)
    table.add(0)
    pool.write(0, [1, 2, 3, 4, 5, 6])
    table.share(1, 0, 5)
    assert len(pool.write(0, [7])) == 1  # slot 6 of page 1, which sequence 1 holds too
    assert pool.write(1, [9]) == []      # page 1 is sequence 1's alone now
    assert pool.read(0) == [1, 2, 3, 4, 5, 6, 7] and pool.read(1) == [1, 2, 3, 4, 5, 9]


def test_truncate_and_free_give_pages_back_and_a_shared_page_only_with_its_last_holder():
    table = PageTable(num_pages=8, page_size=2)
    pool = Pool(table)
    table.add(0)
    pool.write(0, [1, 2, 3, 4, 5])
    assert table.free_pages == 7 - 3
    table.truncate(0, 3)
    assert table.free_pages == 7 - 2 and pool.read(0) == [1, 2, 3]
    table.share(1, 0, 3)
    table.free(0)
    assert table.free_pages == 7 - 2 and pool.read(1) == [1, 2, 3]
    table.free(1)
    assert table.free_pages == 7


def test_a_write_the_pool_cannot_hold_changes_nothing():
    table = PageTable(num_pages=4, page_size=2)
    table.add(0)
    table.write(0, 4)
    table.add(1)
    with pytest.raises(OutOfPages, match="sequence 1 needs 2 pages to hold 3 slots, 1 are free"):
        table.write(1, 3)
    assert table.length(1) == 0 and table.pages(1) == [] and table.free_pages == 1
    assert table.pages_to_write(1, 2) == 1


def test_table_array_pads_with_the_padding_page():
    table = PageTable(num_pages=8, page_size=2)
    table.add(7)
    table.write(7, 3)
    table.add(3)
    np.testing.assert_array_equal(table.table_array([3, 7], 3), [[0, 0, 0], table.pages(7) + [0]])
    with pytest.raises(ValueError, match="holds 2 pages, more than 1"):
        table.table_array([7], 1)


@pytest.mark.parametrize("seed", range(5))
def test_random_shares_writes_roll_backs_and_frees_keep_every_sequence_intact(seed):
    rng = np.random.default_rng(seed)
    table = PageTable(num_pages=64, page_size=int(rng.integers(1, 6)))
    pool = Pool(table)
    expected: dict[int, list[int]] = {}
    next_seq, value = 0, 0
    for _ in range(400):
        op = rng.choice(["add", "share", "write", "truncate", "free"], p=[0.1, 0.2, 0.45, 0.15, 0.1])
        live = sorted(expected)
        if op == "add" or not live:
            table.add(next_seq)
            expected[next_seq] = []
            next_seq += 1
        elif op == "share":
            source = int(rng.choice(live))
            length = int(rng.integers(0, len(expected[source]) + 1))
            table.share(next_seq, source, length)
            expected[next_seq] = expected[source][:length]
            next_seq += 1
        elif op == "write":
            seq = int(rng.choice(live))
            values = list(range(value, value + int(rng.integers(1, 9))))
            value += len(values)
            if table.pages_to_write(seq, table.length(seq) + len(values)) > table.free_pages:
                continue
            pool.write(seq, values)
            expected[seq] += values
        elif op == "truncate":
            seq = int(rng.choice(live))
            length = int(rng.integers(0, len(expected[seq]) + 1))
            table.truncate(seq, length)
            expected[seq] = expected[seq][:length]
        else:
            seq = int(rng.choice(live))
            table.free(seq)
            del expected[seq]
        for seq, tokens in expected.items():
            assert pool.read(seq) == tokens
        check_counts(table, list(expected))
