"""Checks on Prefill/Decode arguments before any state changes. Every failure is a
``ValueError`` naming the request and field (the servicer turns it into INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Sequence

from shard.batch import RequestState
from shard.records import PrefillBatch, RequestInput


def _check_blocks(
    where: str, block_ids: Sequence[int], num_tokens: int, block_size: int, num_blocks: int
) -> None:
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise ValueError(
            f"{where}: block_ids has {len(block_ids)} blocks but {num_tokens} tokens need {needed} "
            f"(block_size {block_size})"
        )
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{where}: block ids {bad[:5]} out of range [0, {num_blocks})")


def validate_request(r: RequestInput, block_size: int, num_blocks: int, vocab_size: int) -> None:
    """Raises ValueError on an inconsistent request."""
    where = f"request {r.request_id}"
    n = len(r.input_ids)
    if n == 0:
        raise ValueError(f"{where}: input_ids is empty")
    if not 0 <= r.cache_len < n:
        raise ValueError(
            f"{where}: cache_len={r.cache_len} must be < len(input_ids)={n} "
            "(at least one token must be computed)"
        )
    if r.num_generated > n:
        raise ValueError(f"{where}: num_generated={r.num_generated} > len(input_ids)={n}")
    bad = [t for t in r.input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: input_ids {bad[:5]} out of vocabulary range [0, {vocab_size})")
    _check_blocks(where, r.block_ids, n, block_size, num_blocks)


def validate_prefill(
    batch: PrefillBatch, block_size: int, num_blocks: int, vocab_size: int
) -> None:
    """Raises ValueError on an empty batch, repeated request ids or a bad request."""
    if not batch.requests:
        raise ValueError(f"batch {batch.batch_id}: no requests")
    ids = [r.request_id for r in batch.requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"batch {batch.batch_id}: request ids repeat")
    for r in batch.requests:
        validate_request(r, block_size, num_blocks, vocab_size)


def validate_decode(
    requests: Sequence[RequestState],
    appends: dict[int, list[int]],
    block_size: int,
    num_blocks: int,
) -> None:
    """Check block appends name known requests with block ids in range, and every
    request has a block for its next token (position seq_len) once they are applied.

    NOTE: O(1) per request plus the appended ids: block tables were checked when their
    blocks arrived, and this runs on every decode step.

    Raises:
        ValueError: unknown request id in appends, a block id out of range, or a block
            table too short.
    """
    if appends:
        known = {r.request_id for r in requests}
        unknown = sorted(set(appends) - known)
        if unknown:
            raise ValueError(
                f"block_appends name request ids {unknown} not in the decoded batches"
            )
        for rid, blocks in appends.items():
            bad = [b for b in blocks if not 0 <= b < num_blocks]
            if bad:
                raise ValueError(
                    f"request {rid}: block ids {bad[:5]} out of range [0, {num_blocks})"
                )
    for r in requests:
        have = len(r.block_table) + len(appends.get(r.request_id, ())) if appends else len(
            r.block_table
        )
        if have * block_size < r.seq_len + 1:
            needed = -(-(r.seq_len + 1) // block_size)
            raise ValueError(
                f"request {r.request_id}: block_ids has {have} blocks but {r.seq_len + 1} "
                f"tokens need {needed} (block_size {block_size})"
            )
