"""RequestTable: requests held by id; decoding rows in row order, their device tensors
always matching the host records (finish, join, append_blocks, clear)."""

from __future__ import annotations

import random

import pytest
import torch

from shard.requests import RequestState, RequestTable
from shard.sampling_types import SamplingParams

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def state(rid: int, num_blocks: int = 1, seq_len: int = 2, **sampling: object) -> RequestState:
    """A request whose block table starts with block ``rid`` (so a row shows whose it is)."""
    blocks = [rid] + [1000 + rid * 10 + k for k in range(num_blocks - 1)]
    return RequestState(rid, blocks, list(range(3, 3 + seq_len)), seq_len, 0,
                        SamplingParams(**sampling))  # type: ignore[arg-type]


def join(table: RequestTable, *states: RequestState) -> None:
    """Hold ``states`` and make them decoding rows, each with a first token 100 + id."""
    for s in states:
        if s.request_id not in table:
            table.add(s)
        s.num_generated += 1
        s.token_ids.append(100 + s.request_id)
    table.join(states, torch.tensor([100 + s.request_id for s in states]), CPU)


def ids(table: RequestTable) -> list[int]:
    return [r.request_id for r in table.decoding]


def check_rows(table: RequestTable) -> None:
    """The device rows are the host's decoding records, in the same order."""
    if not table.decoding:
        assert table.rows is None
        return
    rows = table.rows
    assert rows is not None and len(rows) == len(table.decoding)
    assert rows.tokens.tolist() == [r.last_token for r in table.decoding]
    assert rows.seq_lens.tolist() == [r.seq_len for r in table.decoding]
    for i, r in enumerate(table.decoding):
        assert rows.block_tables[i, : len(r.block_table)].tolist() == r.block_table, r.request_id
        assert r.decoding and r.request_id in table and table.get(r.request_id) is r


def test_rows_keep_their_order_when_requests_leave_and_join() -> None:
    table = RequestTable()
    join(table, state(1), state(2, num_blocks=3), state(3))
    join(table, state(4, num_blocks=2))
    assert ids(table) == [1, 2, 3, 4]
    check_rows(table)
    table.finish([3, 1])
    assert ids(table) == [2, 4] and len(table) == 2 and 1 not in table
    assert table.rows is not None and table.rows.block_tables[:, 0].tolist() == [2, 4]
    check_rows(table)
    join(table, state(1))  # an id that left may come back: it is a new row, last
    assert ids(table) == [2, 4, 1]
    check_rows(table)
    table.finish([2, 4, 1])
    assert table.decoding == [] and table.rows is None and len(table) == 0


def test_requests_being_prefilled_are_held_but_not_rows() -> None:
    table = RequestTable()
    join(table, state(1))
    chunked = state(2, num_blocks=4, seq_len=5)
    table.add(chunked)
    assert 2 in table and len(table) == 2 and ids(table) == [1] and not chunked.decoding
    table.append_blocks({2: [70, 71]})
    assert chunked.block_table[-2:] == [70, 71]
    check_rows(table)
    table.finish([2])  # leaving before its prefill completes changes no row
    assert ids(table) == [1] and 2 not in table
    check_rows(table)


def test_append_blocks_widen_the_device_rows() -> None:
    table = RequestTable()
    join(table, state(1), state(2, num_blocks=2), state(3))
    assert table.rows is not None and table.rows.block_tables.shape[1] == 2
    table.append_blocks({3: [30, 31, 32], 1: [10]})
    assert table.get(3).block_table == [3, 30, 31, 32] and table.get(1).block_table == [1, 10]
    assert table.rows.block_tables.shape[1] >= 4
    check_rows(table)
    table.append_blocks({})
    check_rows(table)


def test_check_finished_and_get_name_the_ids() -> None:
    table = RequestTable()
    join(table, state(1), state(2))
    with pytest.raises(ValueError, match=r"finished_request_ids \[7, 9\] are not held"):
        table.check_finished([2, 9, 7])
    with pytest.raises(ValueError, match="finished_request_ids repeat"):
        table.check_finished([1, 1])
    table.check_finished([2, 1])
    with pytest.raises(ValueError, match="request 5 is not held by this shard"):
        table.get(5)
    with pytest.raises(AssertionError, match="request 1 is held"):
        table.add(state(1))
    assert ids(table) == [1, 2]
    check_rows(table)


def test_kind_follows_membership() -> None:
    table = RequestTable()
    join(table, state(1), state(2))
    assert table.kind.plain_greedy and not table.kind.has_penalty
    join(table, state(3, repetition_penalty=1.2))
    assert not table.kind.plain_greedy and table.kind.has_penalty
    table.finish([3])
    assert table.kind.plain_greedy and not table.kind.has_penalty


def test_clear_drops_everything() -> None:
    table = RequestTable()
    join(table, state(1))
    table.add(state(2))
    table.clear()
    assert len(table) == 0 and table.decoding == [] and table.rows is None
    join(table, state(1))
    assert ids(table) == [1]
    check_rows(table)


@pytest.mark.parametrize("seed", range(8))
def test_random_cycles_keep_device_rows_equal_to_the_host(seed: int) -> None:
    """Random add / join / finish / append_blocks / decode cycles: the rows stay in the
    order the requests joined (minus those that left), and the device rows equal the
    host records after every operation."""
    rng = random.Random(seed)
    table = RequestTable()
    order: list[int] = []  # the expected row order
    pending: list[int] = []  # held, prefill not complete
    next_id = 0
    for _ in range(200):
        op = rng.choice(["add", "join", "join", "finish", "append", "decode"])
        if op == "add":
            s = state(next_id, num_blocks=rng.randint(1, 6), seq_len=rng.randint(1, 20))
            table.add(s)
            pending.append(next_id)
            next_id += 1
        elif op == "join" and pending:
            joining = rng.sample(pending, rng.randint(1, len(pending)))
            join(table, *(table.get(rid) for rid in joining))
            pending = [rid for rid in pending if rid not in joining]
            order += joining
        elif op == "finish":
            held = order + pending
            leaving = rng.sample(held, rng.randint(0, min(3, len(held))))
            table.check_finished(leaving)
            table.finish(leaving)
            order = [rid for rid in order if rid not in leaving]
            pending = [rid for rid in pending if rid not in leaving]
        elif op == "append":
            held = order + pending
            chosen = rng.sample(held, rng.randint(0, min(4, len(held))))
            table.append_blocks({rid: [rng.randrange(4096) for _ in range(rng.randint(1, 3))]
                                 for rid in chosen})
        elif op == "decode" and table.rows is not None:
            next_tokens = torch.tensor([rng.randrange(256) for _ in order])
            table.rows.advance(next_tokens)
            for r, token in zip(table.decoding, next_tokens.tolist(), strict=True):
                r.append_token(token)
        assert ids(table) == order
        assert len(table) == len(order) + len(pending)
        check_rows(table)


def test_request_state_append_token() -> None:
    r = RequestState(1, [0], [5, 6, 7], seq_len=2, num_generated=1, sampling=SamplingParams())
    r.append_token(9)
    assert (r.seq_len, r.token_ids, r.num_generated, r.generated_tokens) == (
        3,
        [5, 6, 7, 9],
        2,
        [7, 9],
    )
