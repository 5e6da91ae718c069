"""With the default budgets a long prompt is prefilled in chunks, and the running batch
decodes in the same step as every chunk (mixed steps; the router's launcher derivation,
a real shard)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from router.config import ServerConfig
from router.launcher import build_state
from router.request import ErrorEvent, GenerationRequest, SamplingParams, StoppingParams
from router.shard_client import ShardClient
from shard.config import ShardConfig
from shard.pb import shard_pb2 as pb

LONG_PROMPT_TOKENS = 1500


class RecordingClient(ShardClient):
    """A real shard client that records each step: ``("prefill", [(request id, start,
    end)])``, the tokens each request computes (``"mixed"`` when the rows step too), or
    ``("decode", [request ids])``, the rows it steps (followed here as a shard keeps
    them: in the order their prompts complete, until they are finished)."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__(addresses)
        self.calls: list[tuple[str, list[tuple[int, int, int]] | list[int]]] = []
        self.held: dict[int, list[int]] = {}  # request id -> [tokens computed, total]
        self.rows: list[int] = []

    def _finish(self, finished: Sequence[int]) -> None:
        for rid in finished:
            del self.held[rid]
        self.rows = [rid for rid in self.rows if rid not in finished]

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        self._finish(request.finished_request_ids)
        chunks = []
        for c in request.cached_requests:
            start, total = self.held[c.id]
            end = total if c.num_tokens == 0 else start + c.num_tokens
            chunks.append((c.id, start, end))
        for r in request.new_requests:
            total = len(r.input_ids)
            end = total if r.num_tokens == 0 else min(r.cache_len + r.num_tokens, total)
            self.held[r.id] = [r.cache_len, total]
            chunks.append((r.id, r.cache_len, end))
        for rid, _, end in chunks:
            self.held[rid][0] = end
            if end == self.held[rid][1]:
                self.rows.append(rid)
        self.calls.append(("mixed" if request.decode else "prefill", chunks))
        return await super().prefill(request)

    async def decode(self, request: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        self._finish(request.finished_request_ids)
        assert len(self.rows) == num_rows, (self.rows, num_rows)
        self.calls.append(("decode", list(self.rows)))
        return await super().decode(request, num_rows)


def greedy(input_ids: list[int], max_new_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        input_ids=tuple(input_ids), sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


async def test_default_budgets_chunk_a_long_prompt_between_decode_steps(
    tiny_long_shard_address: str, tiny_long_model_dir: Path
) -> None:
    client = RecordingClient([tiny_long_shard_address])
    await client.wait_ready(30)
    config = ServerConfig(
        shard=ShardConfig(model_path=str(tiny_long_model_dir), model_id="tiny"),
        budget_flags={"max_batch_prefill_tokens": None, "max_input_tokens": None,
                      "max_total_tokens": None},
    )
    state, _ = await build_state(config, client)
    engine = state.engine
    budgets = engine.config
    # On CPU: 512-token chunks, while prompts may be up to 4095 tokens long.
    assert budgets.max_batch_prefill_tokens == 512
    assert budgets.max_input_tokens == 4095
    engine.start()
    try:
        running = engine.generate(greedy(engine.tokenizer.encode("Once upon a time"), 300))
        for _ in range(3):
            assert not isinstance(await anext(running), ErrorEvent)
        long_ids = engine.tokenizer.encode("word " * LONG_PROMPT_TOKENS)[:LONG_PROMPT_TOKENS]
        first_call = len(client.calls)
        events = [event async for event in engine.generate(greedy(long_ids, 2))]
        assert [e.finish is not None for e in events] == [False, True]
        await running.aclose()
    finally:
        await engine.stop()
        await client.close()

    calls = client.calls[first_call:]
    long_id = 1
    chunks = [
        (kind, chunk) for kind, items in calls if kind != "decode"
        for chunk in items if isinstance(chunk, tuple) and chunk[0] == long_id
    ]
    # 1500 tokens in chunks of at most 512 (sized by the ITL target), one after another
    assert len(chunks) >= 3
    assert chunks[0][1][1] == 0 and chunks[-1][1][2] == LONG_PROMPT_TOKENS
    for (_, (_, _, end)), (_, (_, start, _)) in itertools.pairwise(chunks):
        assert start == end
    assert all(end - start <= 512 for _, (_, start, end) in chunks)
    # the running request decodes in the same step as every chunk
    assert all(kind == "mixed" for kind, _ in chunks), chunks
