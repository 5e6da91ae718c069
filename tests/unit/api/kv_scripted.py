"""A scripted shard group that also keeps what its KV cache holds.

:class:`KvScriptedShardClient` is :class:`~tests.unit.api.scripted.ScriptedShardClient`
(the step contract, tokens chosen by a script) plus the KV cache as the router's block
tables fill it: each computed position writes its token id into its block's slot, the
way a rank writes K/V. A step then fails with an AssertionError when the router

- sends a request whose ``cache_len`` claims prefix blocks that do not hold its tokens
  (a prefix-cache hit on blocks never computed, or overwritten since);
- has a position computed into a block slot that another request still reads with a
  different token (a block given to two owners).

Steps can be made to fail (``fail_steps``: the 1-based numbers of Prefill/Decode calls
that raise :class:`~router.shard_client.ShardError` and compute nothing), as a rank that
rejects a step or fails in its forward; the cache keeps what earlier steps wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from router.shard_client import ShardError
from shard.pb import shard_pb2 as pb
from tests.unit.api.scripted import ScriptedShardClient


@dataclass
class _Held:
    tokens: list[int]  # input ids, then every token sampled for the request
    blocks: list[int]
    cached: int = 0  # leading positions whose K/V are written


@dataclass
class KvScriptedShardClient(ScriptedShardClient):
    """Scripted shard group with a KV cache of token ids (see the module docstring)."""

    fail_steps: set[int] = field(default_factory=set)
    kv: dict[int, list[int | None]] = field(default_factory=dict)  # block -> token per slot
    held: dict[int, _Held] = field(default_factory=dict)
    calls: int = 0

    def _enter(self, method: str, finished: Sequence[int]) -> None:
        """Count the call, fail it when asked, then drop what leaves before it."""
        self.calls += 1
        if self.calls in self.fail_steps:
            raise ShardError(0, method, grpc.StatusCode.INTERNAL, "scripted failure")
        if self.restart:
            self.held.clear()
        for rid in finished:
            self.held.pop(rid, None)

    def _readers(self, block: int, slot: int, writer: int) -> list[int]:
        position_in = [(rid, h.blocks.index(block)) for rid, h in self.held.items()
                       if rid != writer and block in h.blocks]
        return [rid for rid, index in position_in
                if index * self.block_size + slot < self.held[rid].cached]

    def _write(self, rid: int, start: int, end: int) -> None:
        held = self.held[rid]
        for position in range(start, end):
            index, slot = divmod(position, self.block_size)
            assert index < len(held.blocks), f"request {rid}: no block for position {position}"
            block = held.blocks[index]
            slots = self.kv.setdefault(block, [None] * self.block_size)
            token = held.tokens[position]
            if slots[slot] is not None and slots[slot] != token:
                readers = self._readers(block, slot, rid)
                assert not readers, (
                    f"request {rid} overwrites block {block} slot {slot}, which requests "
                    f"{readers} still read")
            slots[slot] = token
        held.cached = max(held.cached, end)

    def _check_prefix(self, request: pb.NewRequest) -> None:
        for position in range(request.cache_len):
            index, slot = divmod(position, self.block_size)
            block = request.block_ids[index]
            found = self.kv.get(block, [None] * self.block_size)[slot]
            assert found == request.input_ids[position], (
                f"request {request.id}: cache_len={request.cache_len}, but block {block} "
                f"slot {slot} holds {found}, not token {request.input_ids[position]} "
                "(a prefix-cache hit on K/V never computed or since overwritten)")

    async def prefill(self, step: pb.PrefillRequest) -> pb.PrefillResponse:
        rows = self._rows_stepping(step.finished_request_ids) if step.decode else []
        self._enter("Prefill", step.finished_request_ids)
        self._write_rows(rows, step.row_appends)  # a mixed step's rows, same forward
        for cached in step.cached_requests:
            held = self.held[cached.id]
            held.blocks.extend(cached.new_block_ids)
            end = len(held.tokens) if cached.num_tokens == 0 else held.cached + cached.num_tokens
            self._write(cached.id, held.cached, end)
        for request in step.new_requests:
            self._check_prefix(request)
            self.held[request.id] = _Held(list(request.input_ids), list(request.block_ids),
                                          request.cache_len)
            end = (len(request.input_ids) if request.num_tokens == 0
                   else request.cache_len + request.num_tokens)
            self._write(request.id, request.cache_len, end)
        response = await super().prefill(step)
        for rid, token in zip(rows, response.decode.token_ids, strict=True):
            self.held[rid].tokens.append(token)
        for generation in response.generations:
            self.held[generation.request_id].tokens.append(generation.token_id)
        return response

    async def decode(self, step: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        rows = self._rows_stepping(step.finished_request_ids)
        self._enter("Decode", step.finished_request_ids)
        self._write_rows(rows, step.cached_requests)
        response = await super().decode(step, num_rows)
        for rid, token in zip(self.rows, response.token_ids, strict=True):
            self.held[rid].tokens.append(token)
        return response

    def _rows_stepping(self, finished: Sequence[int]) -> list[int]:
        """The rows a step that decodes computes (none after a restart)."""
        leaving = set(finished)
        return [] if self.restart else [rid for rid in self.rows if rid not in leaving]

    def _write_rows(self, rows: list[int], appends: Sequence[pb.CachedRequest]) -> None:
        for cached in appends:
            self.held[cached.id].blocks.extend(cached.new_block_ids)
        for rid in rows:  # each row computes the K/V of its last sampled token
            last = len(self.held[rid].tokens) - 1
            self._write(rid, last, last + 1)
