"""KV block allocation: the router decides which cache blocks each sequence uses.

Blocks are reference counted so that a block can be shared (prefix cache) and is
returned to the free list only when its last owner lets go.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free."""


class BlockManager:
    """Free list and reference counts of ``num_blocks`` KV blocks of ``block_size`` tokens.

    Args:
        num_blocks: Blocks in the cache (the minimum over shard ranks after Warmup).
        block_size: Tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with no owner."""
        return len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks are free."""
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks, each with reference count 1.

        Raises:
            OutOfBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > len(self._free):
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block in blocks:
            assert self._ref_counts[block] == 0, f"free block {block} has an owner"
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one owner to each of ``blocks`` (already allocated)."""
        for block in blocks:
            assert self._ref_counts[block] > 0, f"block {block} is not allocated"
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one owner from each of ``blocks``; blocks left with none become free."""
        for block in blocks:
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        """Owners of ``block`` (0 = free)."""
        return self._ref_counts[block]

    def check_integrity(self) -> None:
        """Assert the free list and reference counts agree (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block} has a negative reference count"
            assert (count == 0) == (block in free), f"block {block}: count {count} vs free list"
