"""Per-step attention metadata, shared by every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Describes one forward over a flattened batch of ``num_tokens`` new tokens from
    ``batch`` sequences. Sequence ``i`` contributes ``q_len_i`` new tokens, which are the
    last ``q_len_i`` tokens of its context of ``seq_lens[i]`` tokens (so the first
    ``seq_lens[i] - q_len_i`` are a cached prefix).

    Attributes:
        is_prefill: True for prefill (q_len_i >= 1, possibly over a cached prefix);
            False for decode (q_len_i == 1 for all i).
        slot_mapping: [num_tokens] int64, cache slot of each new token
            (``block_id * block_size + offset``); < 0 means "do not write".
        cu_seqlens_q: [batch + 1] int32, prefix sums of q_len_i (starts at 0).
        cu_seqlens_k: [batch + 1] int32, prefix sums of seq_lens (starts at 0).
        seq_lens: [batch] int32, total context length of each sequence in tokens,
            cached prefix plus new tokens.
        max_seqlen_q: max q_len_i (python int).
        max_seqlen_k: max seq_lens (python int).
        block_tables: [batch, max_blocks] int32, block ids of each sequence in order,
            padded with 0 (padding is never read: it lies beyond seq_lens).
        block_size: tokens per KV block, the unit of ``block_tables`` and
            ``slot_mapping`` (python int).
        has_skipped_slots: whether ``slot_mapping`` has entries < 0 (known when it is
            built, so no backend has to look at the tensor).
        has_cached_prefix: whether any sequence has a cached prefix (``seq_lens[i] >
            q_len_i``; known when built). A prefill without one attends over its new
            tokens alone, so a backend may read their K/V as computed instead of from
            the cache. True (the safe answer) unless the builder says otherwise.
        decode_rows: in a prefill step, the last ``decode_rows`` sequences are decoding
            rows computing one token each (a mixed step), which a backend may attend
            with its decode kernel; 0 otherwise.
        decode_max_seqlen_k: the longest context among those rows (python int).

    What a backend derives from these once per step (host-side plans, index tensors)
    it derives in :meth:`~shard.attention.base.AttentionBackend.prepare`.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor
    block_size: int
    has_skipped_slots: bool
    has_cached_prefix: bool = True
    decode_rows: int = 0
    decode_max_seqlen_k: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
