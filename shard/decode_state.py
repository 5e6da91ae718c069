"""Per-request decode state kept on the device, one row per running request.

A decode step needs, for every running request, its last sampled token, how many of its
tokens are in the KV cache and its block table. Rebuilding those from Python lists every
step costs host time proportional to batch × context; instead each cached batch keeps
them as device tensors that change by deltas: the sampler writes the next tokens in
place, ``seq_lens`` grows by one, new blocks are scattered into ``block_tables``, and a
batch that gains or loses requests is concatenated or row-selected on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shard.attention.metadata import AttentionMetadata
from shard.host_copy import to_device
from shard.inputs import ModelInputs


@dataclass
class DecodeRows:
    """Device tensors of a batch's running requests, in batch order.

    Attributes:
        tokens: [batch] int64, each request's last sampled token (the next input; its
            K/V are not in the cache yet).
        seq_lens: [batch] int32, tokens of each request whose K/V are in the cache (=
            the position of ``tokens``).
        block_tables: [batch, width] int32 block ids in order, padded with 0 (padding
            lies beyond every sequence's length and is never read).
    """

    tokens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def build(
        cls,
        tokens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        device: torch.device,
    ) -> DecodeRows:
        """Rows of new requests, after their prefill.

        Args:
            tokens: each request's last sampled token: host ids, or an int64 tensor on
                ``device`` (a prefill's sampled ids, taken over without a copy).
            seq_lens: tokens in the cache per request.
            block_tables: each request's block ids.
        """
        width = max(1, *(len(t) for t in block_tables))
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        return cls(
            tokens=(tokens if isinstance(tokens, torch.Tensor)
                    else to_device(tokens, torch.int64, device)),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(padded, torch.int32, device),
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def concatenate(cls, parts: Sequence[DecodeRows]) -> DecodeRows:
        """Rows of ``parts`` one after the other (block tables padded to the widest)."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.block_tables.shape[1] for p in parts)
        return cls(
            tokens=torch.cat([p.tokens for p in parts]),
            seq_lens=torch.cat([p.seq_lens for p in parts]),
            block_tables=torch.cat(
                [F.pad(p.block_tables, (0, width - p.block_tables.shape[1])) for p in parts]
            ),
        )

    def select(self, rows: Sequence[int]) -> DecodeRows:
        """Keep ``rows`` (indices into this batch, in the order given)."""
        if list(rows) == list(range(len(self))):
            return self
        index = to_device(rows, torch.int64, self.tokens.device)
        return DecodeRows(
            tokens=self.tokens.index_select(0, index),
            seq_lens=self.seq_lens.index_select(0, index),
            block_tables=self.block_tables.index_select(0, index),
        )

    def append_blocks(self, appends: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """Scatter new block ids into the block tables.

        Args:
            appends: (row, first column, block ids): ``block_ids[k]`` goes to column
                ``first column + k`` of ``row``. The table widens when needed.
        """
        if not appends:
            return
        rows: list[int] = []
        cols: list[int] = []
        values: list[int] = []
        for row, start, blocks in appends:
            rows.extend([row] * len(blocks))
            cols.extend(range(start, start + len(blocks)))
            values.extend(blocks)
        width = max(cols) + 1
        if width > self.block_tables.shape[1]:
            # NOTE: grow by doubling so a long generation widens O(log n) times.
            grow = max(width, 2 * self.block_tables.shape[1]) - self.block_tables.shape[1]
            self.block_tables = F.pad(self.block_tables, (0, grow))
        device = self.block_tables.device
        self.block_tables.index_put_(
            (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)),
            to_device(values, torch.int32, device),
        )

    def advance(self, next_tokens: torch.Tensor) -> None:
        """Record a decode step: the input tokens are now cached, ``next_tokens``
        ([batch] int64) are the new last tokens."""
        self.tokens.copy_(next_tokens)
        self.seq_lens += 1

    def advance_by(self, last_tokens: Sequence[int], counts: Sequence[int]) -> None:
        """Record a speculative step: row i cached ``counts[i]`` more tokens (its input
        token and its accepted guesses) and ``last_tokens[i]`` is its new last token."""
        device = self.tokens.device
        self.tokens.copy_(to_device(last_tokens, torch.int64, device))
        self.seq_lens += to_device(counts, torch.int32, device)

    def model_inputs(self, block_size: int, max_seqlen_k: int) -> ModelInputs:
        """Inputs of one decode step, computed on the device without host round trips.

        Args:
            block_size: tokens per KV block.
            max_seqlen_k: the longest context after this step (host int), tokens.
        """
        positions = self.seq_lens.to(torch.int64)  # the input token's position
        slot_mapping = decode_slot_mapping(self.block_tables, positions, block_size)
        seq_lens = self.seq_lens + 1
        n = len(self)
        cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=positions.device)
        metadata = AttentionMetadata(
            is_prefill=False,
            slot_mapping=slot_mapping,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0)),
            seq_lens=seq_lens,
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            block_tables=self.block_tables,
            block_size=block_size,
            has_skipped_slots=False,
        )
        return ModelInputs(
            input_ids=self.tokens,
            positions=positions,
            metadata=metadata,
            last_token_indices=cu_seqlens_q[1:].to(torch.int64) - 1,
        )


def decode_slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Cache slot of each row's token at ``positions`` (PagedAttention's
    ``block_table[p // block_size] * block_size + p % block_size``).

    Args:
        block_tables: [batch, width] int32.
        positions: [batch] int64.

    Returns:
        [batch] int64.
    """
    blocks = block_tables.gather(1, (positions // block_size)[:, None]).squeeze(1)
    return blocks.to(torch.int64) * block_size + positions % block_size
