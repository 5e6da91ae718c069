"""Block manager invariants under random allocate / share / free sequences."""

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

    @rule(count=st.integers(min_value=1, max_value=8))
    def allocate(self, count: int) -> None:
        if count > self.manager.num_free:
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(count)
            return
        blocks = self.manager.allocate(count)
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
