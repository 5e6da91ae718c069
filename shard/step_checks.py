"""Checks on Prefill/Decode arguments before any state changes. Every failure is a
``ValueError`` naming the request and field (the servicer turns it into INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shard.records import CachedRequest, DecodeStep, NewRequest, PrefillStep
from shard.requests import RequestState, RequestTable


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


def validate_request(r: NewRequest, block_size: int, num_blocks: int, vocab_size: int) -> None:
    """Raises ValueError on an inconsistent new request."""
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
    if r.prompt_logprobs and r.partial:
        raise ValueError(f"{where}: a request with prompt_logprobs cannot come in chunks")
    bad = [t for t in r.input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: input_ids {bad[:5]} out of vocabulary range [0, {vocab_size})")
    _check_blocks(where, r.block_ids, n, block_size, num_blocks)


def _check_appends(
    cached: Sequence[CachedRequest], staying: Callable[[int], RequestState], num_blocks: int
) -> None:
    ids = [c.request_id for c in cached]
    if len(set(ids)) != len(ids):
        raise ValueError("cached_requests name a request more than once")
    for c in cached:
        staying(c.request_id)
        bad = [b for b in c.new_block_ids if not 0 <= b < num_blocks]
        if bad:
            raise ValueError(
                f"request {c.request_id}: new_block_ids {bad[:5]} out of range [0, {num_blocks})"
            )


def _staying(table: RequestTable, finished: Sequence[int]) -> Callable[[int], RequestState]:
    """A lookup of the requests held that do not leave in this step (ValueError else)."""
    table.check_finished(finished)
    leaving = set(finished)

    def get(request_id: int) -> RequestState:
        if request_id in leaving:
            raise ValueError(f"request {request_id} is finished in the same step")
        return table.get(request_id)

    return get


def validate_prefill(
    step: PrefillStep, table: RequestTable, block_size: int, num_blocks: int, vocab_size: int
) -> None:
    """Check a Prefill against the requests held, before anything changes.

    Raises:
        ValueError: nothing to compute; a finished id not held; a cached request not
            held, leaving in the same step, already decoding, or with blocks out of
            range or too few for its chunk; a new request id held (and not leaving) or
            repeated; a bad new request (:func:`validate_request`); in a mixed step,
            what :func:`validate_decode` refuses of ``row_appends``; row appends
            without ``decode``.
    """
    if not step.new_requests and not step.cached_requests:
        raise ValueError("a Prefill must compute at least one request")
    staying = _staying(table, step.finished_request_ids)
    if step.decode:
        _check_rows(step.row_appends, step.finished_request_ids, staying, table, block_size,
                    num_blocks)
    elif step.row_appends:
        raise ValueError("row_appends are for a mixed step (decode = true)")
    _check_appends(step.cached_requests, staying, num_blocks)
    for c in step.cached_requests:
        state = staying(c.request_id)
        if state.decoding:
            raise ValueError(f"request {c.request_id}: its prefill is already complete")
        end = len(state.token_ids) if c.num_tokens == 0 else state.seq_len + c.num_tokens
        if end > len(state.token_ids):
            raise ValueError(
                f"request {c.request_id}: num_tokens={c.num_tokens} goes past its prompt "
                f"({len(state.token_ids) - state.seq_len} tokens left)")
        have = len(state.block_table) + len(c.new_block_ids)
        if have * block_size < end:
            raise ValueError(
                f"request {c.request_id}: block_ids has {have} blocks but {end} tokens need "
                f"{-(-end // block_size)} (block_size {block_size})")
    ids = [r.request_id for r in step.new_requests]
    if len(set(ids)) != len(ids) or set(ids) & {c.request_id for c in step.cached_requests}:
        raise ValueError("new_requests repeat a request id")
    leaving = set(step.finished_request_ids)
    for r in step.new_requests:
        if r.request_id in table and r.request_id not in leaving:
            raise ValueError(f"request {r.request_id} is already held by this shard")
        validate_request(r, block_size, num_blocks, vocab_size)


def validate_decode(
    step: DecodeStep, table: RequestTable, block_size: int, num_blocks: int
) -> None:
    """Check a Decode against the requests held, before anything changes: finished ids
    and cached requests name held requests (cached ones: decoding rows that stay),
    block ids are in range, and every row that steps has a block for its next token
    (position seq_len) once the appends are applied.

    NOTE: O(1) per row plus the appended ids: block tables were checked when their
    blocks arrived, and this runs on every decode step.

    With speculation (``num_speculative_tokens`` k > 0) a row computes up to 1 + k
    tokens (its own bound when a cached request sets ``num_tokens``): its blocks must
    hold them all.

    Raises:
        ValueError: as above (naming the request and field), or a cached request with
            num_tokens above 1 (above 1 + k with speculation).
    """
    staying = _staying(table, step.finished_request_ids)
    _check_rows(step.cached_requests, step.finished_request_ids, staying, table, block_size,
                num_blocks, 1 + step.num_speculative_tokens)


def _check_rows(
    cached: Sequence[CachedRequest], finished: Sequence[int],
    staying: Callable[[int], RequestState], table: RequestTable, block_size: int,
    num_blocks: int, max_tokens: int = 1,
) -> None:
    """The decoding rows' part of a Decode or a mixed step (see :func:`validate_decode`);
    ``max_tokens``: the most tokens a row may compute (1 + the speculative tokens)."""
    _check_appends(cached, staying, num_blocks)
    appended: dict[int, int] = {}
    bounds: dict[int, int] = {}
    for c in cached:
        if not staying(c.request_id).decoding:
            raise ValueError(f"request {c.request_id}: its prefill is not complete")
        if c.num_tokens > max_tokens:
            raise ValueError(
                f"request {c.request_id}: num_tokens={c.num_tokens}: a decode step computes "
                + ("one token per request" if max_tokens == 1 else
                   f"at most 1 + num_speculative_tokens = {max_tokens} tokens per request"))
        appended[c.request_id] = len(c.new_block_ids)
        if c.num_tokens:
            bounds[c.request_id] = c.num_tokens
    leaving = set(finished)
    for r in table.decoding:
        if r.request_id in leaving:
            continue
        have = len(r.block_table) + appended.get(r.request_id, 0)
        tokens = r.seq_len + bounds.get(r.request_id, max_tokens)
        if have * block_size < tokens:
            raise ValueError(
                f"request {r.request_id}: block_ids has {have} blocks but {tokens} "
                f"tokens need {-(-tokens // block_size)} (block_size {block_size})"
            )
