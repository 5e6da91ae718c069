"""Turn sequences into flattened model inputs: token ids, positions, slot mapping and
:class:`AttentionMetadata`. Prefill and decode are the same shape of problem: each
sequence computes tokens ``[start, start + len(token_ids))`` of its context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shard.attention.metadata import AttentionMetadata
from shard.host_copy import to_device


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for one forward.

    Attributes:
        token_ids: tokens to compute (at positions start, start+1, ...).
        start: position of the first of them (= tokens of context before them).
        block_table: the sequence's KV blocks, covering start + len(token_ids) tokens.
        write_from: positions < write_from are not written to the cache (slot -1);
            used when a cached token is recomputed only for its logits.
    """

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    write_from: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class ModelInputs:
    """Flattened inputs of one forward.

    Attributes:
        input_ids: [num_tokens] int64.
        positions: [num_tokens] int64, absolute position of each token.
        metadata: attention metadata for the batch.
        last_token_indices: [batch] int64, row of each sequence's last token in the
            flattened batch (``cu_seqlens_q[1:] - 1``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    last_token_indices: torch.Tensor


def slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    """Cache slot of token ``position``:
    ``block_table[position // block_size] * block_size + position % block_size``."""
    return block_table[position // block_size] * block_size + position % block_size


def build_inputs(
    chunks: Sequence[SeqChunk], block_size: int, is_prefill: bool, device: torch.device
) -> ModelInputs:
    """Build :class:`ModelInputs` for ``chunks`` (one per sequence, in batch order).

    Raises:
        AssertionError: a chunk is empty or its block table is too short (callers
            validate requests first).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_q, cu_k, seq_lens = [0], [0], []
    for c in chunks:
        assert len(c.token_ids) > 0, "a sequence must compute at least one token"
        assert len(c.block_table) * block_size >= c.end, f"block table too short for {c.end} tokens"
        input_ids.extend(c.token_ids)
        positions.extend(range(c.start, c.end))
        slots.extend(
            slot(c.block_table, p, block_size) if p >= c.write_from else -1
            for p in range(c.start, c.end)
        )
        cu_q.append(cu_q[-1] + len(c.token_ids))
        cu_k.append(cu_k[-1] + c.end)
        seq_lens.append(c.end)
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = [list(c.block_table) + [0] * (max_blocks - len(c.block_table)) for c in chunks]

    def tensor(values: Sequence[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, device)

    metadata = AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=tensor(slots, torch.int64),
        cu_seqlens_q=tensor(cu_q, torch.int32),
        cu_seqlens_k=tensor(cu_k, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        max_seqlen_q=max(len(c.token_ids) for c in chunks),
        max_seqlen_k=max(seq_lens),
        block_tables=tensor(tables, torch.int32),
        block_size=block_size,
        has_skipped_slots=any(s < 0 for s in slots),
    )
    return ModelInputs(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        metadata=metadata,
        last_token_indices=tensor([n - 1 for n in cu_q[1:]], torch.int64),
    )
