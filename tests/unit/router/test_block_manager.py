"""Block manager invariants under random allocate / share / free sequences, and the
locality of its allocations (consecutive ids for a growing table)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.block_manager import BlockManager, OutOfBlocksError

NUM_BLOCKS = 24


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, block_size=16)
        self.owners: list[list[int]] = []  # each owner's blocks

    @rule(count=st.integers(min_value=1, max_value=8),
          lookahead=st.integers(min_value=0, max_value=6), data=st.data())
    def allocate(self, count: int, lookahead: int, data: st.DataObject) -> None:
        # continue an owner's table (after its last block) or start a new one
        extend = self.owners and data.draw(st.booleans())
        after = data.draw(st.sampled_from(self.owners))[-1] if extend else None
        if count > self.manager.num_free:
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(count, after=after, lookahead=lookahead)
            return
        blocks = self.manager.allocate(count, after=after, lookahead=lookahead)
        assert len(set(blocks)) == count
        for other in self.owners:
            assert not set(other) & set(blocks) or all(
                self.manager.ref_count(b) > 1 for b in set(other) & set(blocks)
            )
        self.owners.append(blocks)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(self.owners))
        prefix = source[: data.draw(st.integers(min_value=1, max_value=len(source)))]
        self.manager.share(prefix)
        self.owners.append(list(prefix))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(min_value=0, max_value=len(self.owners) - 1))
        self.manager.free(self.owners.pop(index))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release_reservation(self, data: st.DataObject) -> None:
        self.manager.release_reservation(data.draw(st.sampled_from(self.owners))[-1])

    @invariant()
    def counts_match_owners(self) -> None:
        self.manager.check_integrity()
        expected = [0] * NUM_BLOCKS
        for blocks in self.owners:
            for block in blocks:
                expected[block] += 1
        assert [self.manager.ref_count(b) for b in range(NUM_BLOCKS)] == expected
        assert self.manager.num_free == expected.count(0)

    def teardown(self) -> None:
        for blocks in self.owners:
            self.manager.free(blocks)
        assert self.manager.num_free == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_blocks_for_tokens() -> None:
    manager = BlockManager(4, block_size=16)
    assert [manager.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_double_free_is_caught() -> None:
    manager = BlockManager(4, block_size=16)
    blocks = manager.allocate(2)
    manager.free(blocks)
    with pytest.raises(AssertionError):
        manager.free(blocks)


def test_tables_grow_on_consecutive_ids_between_interleaved_sequences() -> None:
    """Two tables admitted back to back, then appended one block at a time in turn (as
    decode steps do): each stays one run of ids, thanks to the reservation after it."""
    manager = BlockManager(64, block_size=16)
    a = manager.allocate(3, lookahead=4)
    b = manager.allocate(2, lookahead=4)
    for _ in range(4):
        a += manager.allocate(1, after=a[-1])
        b += manager.allocate(1, after=b[-1])
    assert a == list(range(a[0], a[0] + 7))
    assert b == list(range(b[0], b[0] + 6))
    manager.check_integrity()


def test_without_reservation_interleaved_tables_fragment() -> None:
    """The reservation is what keeps them apart: without it the second table takes the
    ids the first grows into."""
    manager = BlockManager(64, block_size=16)
    a = manager.allocate(3)
    b = manager.allocate(2)
    a += manager.allocate(1, after=a[-1])
    assert b[0] == a[2] + 1 and a[3] != a[2] + 1


def test_reserved_blocks_are_taken_by_others_only_when_nothing_else_is_free() -> None:
    manager = BlockManager(8, block_size=16)
    a = manager.allocate(2, lookahead=3)  # 0, 1; reserves 2, 3, 4
    assert a == [0, 1] and manager.num_free == 6
    assert manager.allocate(3) == [5, 6, 7]  # the unreserved ones first
    assert manager.allocate(2) == [2, 3]  # then the reservation, oldest first
    assert manager.allocate(1, after=a[-1]) == [4]  # a's next id is gone: any free one
    assert manager.num_free == 0
    manager.check_integrity()


def test_release_reservation_returns_the_ids_after_a_finished_table() -> None:
    manager = BlockManager(8, block_size=16)
    a = manager.allocate(2, lookahead=4)  # reserves 2..5
    manager.release_reservation(a[-1])
    manager.free(a)
    # the free list holds 6, 7, then 2..5, then the freed run 0, 1, and nothing is
    # reserved (reserved ids would come after 0, 1)
    assert [manager.allocate(1)[0] for _ in range(8)] == [6, 7, 2, 3, 4, 5, 0, 1]
    manager.check_integrity()


def test_a_new_table_starts_on_a_free_run_that_holds_it() -> None:
    manager = BlockManager(16, block_size=16)
    held = manager.allocate(16)
    manager.free([held[3]])  # a lone free id
    manager.free(held[8:12])  # a free run of four, freed in table order
    assert manager.allocate(3) == [8, 9, 10]  # skips the lone id for the run
    assert manager.allocate(1, after=10) == [11]
    manager.check_integrity()
