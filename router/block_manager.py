"""KV block allocation and the prefix cache: the router decides which blocks hold what.

Blocks are reference counted so that a block can be shared by several sequences and
returns to the pool only when its last owner lets go.

Prefix cache: every full block of a prompt that has been prefilled is indexed by a hash
chained over all tokens up to and including that block (the hash of block i covers
tokens ``[0, (i + 1) * block_size)``), so equal hashes mean equal prefixes. A new
sequence reuses the longest run of indexed blocks at the start of its tokens and only
the rest is prefilled (``cache_len``). A cached block nobody owns stays indexed on an
LRU list and is evicted (unindexed and reused) only when no never-used block is left.
The scheme follows vLLM's automatic prefix caching (chained block hashes).
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free."""


def block_hashes(
    token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained SHA-256 digests of each full block of ``token_ids``.

    Each block is hashed as its ids' 64-bit machine integers, the previous block's digest
    first (digests are compared within one router process only, never stored).

    Args:
        known: Digests already computed for a prefix of the same tokens; only the
            blocks after them are hashed (a growing sequence hashes each block once).

    Returns:
        ``len(token_ids) // block_size`` digests; digest i identifies tokens
        ``[0, (i + 1) * block_size)``.
    """
    digests = list(known)
    first = len(digests) * block_size
    full = len(token_ids) // block_size * block_size
    if full <= first:
        return digests
    # one conversion for all new blocks (a 1024-token prompt hashes in ~0.1 ms, against ~1.8
    # ms for a string of its ids)
    data = memoryview(array.array("q", token_ids[first:full])).cast("B")
    step = block_size * 8  # bytes of one block's ids
    parent = digests[-1] if digests else b""
    for offset in range(0, len(data), step):
        hasher = hashlib.sha256(parent)
        hasher.update(data[offset : offset + step])
        parent = hasher.digest()
        digests.append(parent)
    return digests


class BlockManager:
    """Free pool, reference counts and prefix index of ``num_blocks`` KV blocks.

    Args:
        num_blocks: Blocks in the cache (the minimum over shard ranks after Warmup).
        block_size: Tokens per block.
        enable_prefix_caching: Index prefilled prompt blocks for reuse.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no owner; LRU first
        self._ref_counts = [0] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self.hit_tokens = 0  # prompt tokens served from the prefix cache, cumulative

    @property
    def num_free(self) -> int:
        """Blocks with no owner (never used, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix index."""
        return len(self._block_to_hash)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks can be allocated (evicting cached ones if needed)."""
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks, each with reference count 1; never-used blocks
        first, then the least recently used cached blocks (which leave the index).

        Raises:
            OutOfBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.num_free:
            raise OutOfBlocksError(f"need {num_blocks} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(num_blocks):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._hash_to_block[self._block_to_hash.pop(block)]
            assert self._ref_counts[block] == 0, f"free block {block} has an owner"
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Add one owner to each of ``blocks`` (owned or cached)."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                assert block in self._evictable, f"block {block} is neither owned nor cached"
                del self._evictable[block]
            self._ref_counts[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one owner from each of ``blocks``; a block left with none becomes free
        (kept in the index as evictable when cached). Blocks are released last to first,
        so a sequence's tail is evicted before its head."""
        for block in reversed(blocks):
            assert self._ref_counts[block] > 0, f"block {block} freed twice"
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._block_to_hash:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Cached blocks holding the longest indexed run of ``hashes`` (block digests of
        a sequence, see :func:`block_hashes`), not owned by the caller yet."""
        if not self.enable_prefix_caching:
            return []
        matched = []
        for digest in hashes:
            block = self._hash_to_block.get(digest)
            if block is None:
                break
            matched.append(block)
        return matched

    def register(self, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """Index full blocks whose K/V are now computed: ``hashes[i]`` is held in
        ``blocks[i]`` (the sequence's block table, in order)."""
        if not self.enable_prefix_caching:
            return
        for digest, block in zip(hashes, blocks, strict=False):
            if digest in self._hash_to_block or block in self._block_to_hash:
                continue
            self._hash_to_block[digest] = block
            self._block_to_hash[block] = digest

    def ref_count(self, block: int) -> int:
        """Owners of ``block`` (0 = free)."""
        return self._ref_counts[block]

    def check_integrity(self) -> None:
        """Assert that pools, reference counts and the index agree (used by tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & evictable, "a block is both free and evictable"
        for block, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block} has a negative reference count"
            unowned = block in free or block in evictable
            assert (count == 0) == unowned, f"block {block}: count {count} vs pools"
        assert evictable <= set(self._block_to_hash), "an evictable block is not indexed"
        assert not free & set(self._block_to_hash), "a never-used block is indexed"
        assert {b: h for h, b in self._hash_to_block.items()} == self._block_to_hash
