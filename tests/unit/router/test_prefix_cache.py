"""Prefix index invariants under random admit / append / free / evict sequences.

A shadow model records which token prefix each indexed block holds; every match must
return blocks whose recorded prefix equals the new sequence's tokens.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.block_manager import BlockManager, block_hashes

NUM_BLOCKS = 12
BLOCK_SIZE = 2
tokens_strategy = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=9)


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.sequences: dict[int, tuple[list[int], list[int]]] = {}  # id → (tokens, blocks)
        self.content: dict[int, tuple[int, ...]] = {}  # indexed block → prefix it ends
        self.next_id = 0

    def _allocate(self, count: int, after: int | None = None, lookahead: int = 0) -> list[int]:
        blocks = self.manager.allocate(count, after=after, lookahead=lookahead)
        for block in blocks:  # an evicted block no longer holds its old prefix
            self.content.pop(block, None)
        return blocks

    @rule(tokens=tokens_strategy)
    def admit(self, tokens: list[int]) -> None:
        manager = self.manager
        cached = manager.match_prefix(
            block_hashes(tokens, BLOCK_SIZE)[: (len(tokens) - 1) // BLOCK_SIZE]
        )
        assert len(cached) <= (len(tokens) - 1) // BLOCK_SIZE
        for index, block in enumerate(cached):
            assert self.content[block] == tuple(tokens[: (index + 1) * BLOCK_SIZE])
        needed = manager.blocks_for_tokens(len(tokens)) - len(cached)
        unowned = sum(1 for block in cached if manager.ref_count(block) == 0)
        if not manager.can_allocate(needed + unowned):
            return
        manager.share(cached)
        blocks = cached + self._allocate(needed, cached[-1] if cached else None, lookahead=2)
        manager.register(block_hashes(tokens, BLOCK_SIZE), blocks)
        for index, _ in enumerate(block_hashes(tokens, BLOCK_SIZE)):
            self.content.setdefault(blocks[index], tuple(tokens[: (index + 1) * BLOCK_SIZE]))
        self.sequences[self.next_id] = (list(tokens), blocks)
        self.next_id += 1

    @precondition(lambda self: self.sequences)
    @rule(data=st.data(), token=st.integers(min_value=0, max_value=2))
    def append(self, data: st.DataObject, token: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.sequences)))
        tokens, blocks = self.sequences[seq_id]
        if self.manager.blocks_for_tokens(len(tokens) + 1) > len(blocks):
            if not self.manager.can_allocate(1):
                return
            blocks.extend(self._allocate(1, after=blocks[-1]))
        tokens.append(token)

    @precondition(lambda self: self.sequences)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.sequences)))
        _, blocks = self.sequences.pop(seq_id)
        self.manager.release_reservation(blocks[-1])
        self.manager.free(blocks)

    @invariant()
    def consistent(self) -> None:
        self.manager.check_integrity()
        owners = [0] * NUM_BLOCKS
        for _, blocks in self.sequences.values():
            assert len(set(blocks)) == len(blocks), "a sequence holds a block twice"
            for block in blocks:
                owners[block] += 1
        assert [self.manager.ref_count(b) for b in range(NUM_BLOCKS)] == owners
        assert self.manager.num_free == owners.count(0)

    def teardown(self) -> None:
        for _, blocks in self.sequences.values():
            self.manager.free(blocks)
        assert self.manager.num_free == NUM_BLOCKS
        self.manager.check_integrity()


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_eviction_takes_least_recently_used_and_unindexes() -> None:
    manager = BlockManager(4, block_size=2)
    first = manager.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    manager.register(hashes, first)
    manager.free(first)
    assert manager.num_free == 4 and manager.num_cached == 2
    assert manager.match_prefix(hashes) == first
    taken = manager.allocate(3)  # two never-used blocks, then the LRU cached one
    assert first[1] in taken and manager.num_cached == 1
    assert manager.match_prefix(hashes) == first[:1]
    manager.check_integrity()


def test_incremental_hashes_equal_hashing_from_scratch() -> None:
    tokens = list(range(23))
    prefix = block_hashes(tokens[:9], 4)
    assert block_hashes(tokens, 4, prefix) == block_hashes(tokens, 4)
    assert len(block_hashes(tokens, 4)) == 5


def test_digests_tell_every_token_apart_and_chain_over_the_prefix() -> None:
    base = [7] * 8
    digests = block_hashes(base, 4)
    for position in range(8):
        for other in (8, 2**31, 2**40, 256 * 7):  # ids that share bytes with 7 included
            changed = list(base)
            changed[position] = other
            got = block_hashes(changed, 4)
            # the block holding the change differs, and so does every block after it
            assert all(got[b] != digests[b] for b in range(position // 4, 2))
            assert got[: position // 4] == digests[: position // 4]
    # a block's digest covers the blocks before it: equal blocks at different prefixes
    assert block_hashes([1, 2, 5, 6], 2)[1] != block_hashes([3, 4, 5, 6], 2)[1]
    assert block_hashes(tuple(base), 4) == digests  # any sequence type
