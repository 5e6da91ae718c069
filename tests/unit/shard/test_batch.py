"""BatchStore: concatenate, filter, clear."""

from __future__ import annotations

import pytest
import torch

from shard.batch import BatchStore, CachedBatch, RequestState
from shard.decode_state import DecodeRows
from shard.errors import UnknownBatchError
from shard.sampling_types import SamplingParams


def state(rid: int) -> RequestState:
    return RequestState(rid, [rid], [1, 2, 3], 2, 1, SamplingParams())


def store_with(*batches: tuple[int, list[int]]) -> BatchStore:
    store = BatchStore()
    for bid, rids in batches:
        states = [state(r) for r in rids]
        rows = DecodeRows.build(
            [s.last_token for s in states],
            [s.seq_len for s in states],
            [s.block_table for s in states],
            torch.device("cpu"),
        )
        store.add(CachedBatch(bid, states, rows))
    return store


def test_device_rows_follow_the_requests() -> None:
    # state(r) puts block r in the table: the rows must keep pointing at their request
    store = store_with((7, [1, 2]), (3, [5]), (9, [4]))
    batch = store.concatenate([7, 3, 9])
    assert batch.rows.block_tables[:, 0].tolist() == [1, 2, 5, 4]
    batch = store.filter(7, [4, 2])
    assert batch.request_ids == (2, 4)
    assert batch.rows.block_tables[:, 0].tolist() == [2, 4]
    assert batch.rows.seq_lens.tolist() == [2, 2] and batch.rows.tokens.tolist() == [3, 3]


def test_concatenate_keeps_first_id_and_order() -> None:
    store = store_with((7, [1, 2]), (3, [5]), (9, [4]))
    batch = store.concatenate([7, 3, 9])
    assert (batch.batch_id, batch.request_ids) == (7, (1, 2, 5, 4))
    assert 7 in store and 3 not in store and 9 not in store and len(store) == 1


def test_concatenate_errors_leave_store_unchanged() -> None:
    store = store_with((1, [1]), (2, [2]), (3, [1]))
    with pytest.raises(UnknownBatchError, match="unknown batch id 4"):
        store.concatenate([1, 4])
    with pytest.raises(ValueError, match="request id 1 appears in more than one batch"):
        store.concatenate([1, 3])
    with pytest.raises(ValueError, match="repeat"):
        store.concatenate([1, 1])
    assert len(store) == 3 and store.get(1).request_ids == (1,)


def test_filter_and_clear() -> None:
    store = store_with((1, [10, 11, 12]), (2, [20]))
    assert store.filter(1, [12, 10]).request_ids == (10, 12)
    with pytest.raises(ValueError, match=r"\[99\] are not in batch 1"):
        store.filter(1, [99])
    assert store.filter(1, []).request_ids == ()
    assert 1 not in store
    store.clear(1)  # idempotent
    store.clear(2)
    assert len(store) == 0
    store = store_with((1, [1]), (2, [2]))
    store.clear()
    assert len(store) == 0
    with pytest.raises(ValueError, match="already cached"):
        store_with((1, [1]), (1, [2]))


def test_request_state_append_token() -> None:
    r = RequestState(1, [0], [5, 6, 7], seq_len=2, num_generated=1, sampling=SamplingParams())
    r.append_token(9)
    assert (r.seq_len, r.token_ids, r.num_generated, r.generated_tokens) == (
        3,
        [5, 6, 7, 9],
        2,
        [7, 9],
    )
