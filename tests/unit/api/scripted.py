"""A scripted shard group: the real engine and tokenizer, with tokens chosen by the test.

:class:`ScriptedShardClient` stands in for :class:`router.shard_client.ShardClient`. Each
request generates the token ids its script gives for its prompt, one per step (cycling
when the script is shorter than the generation), with fixed logprobs; alternatives are
ids ``token + 1 ..`` and prompt logprobs are ``-1.0 - position / 100``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shard.pb import shard_pb2 as pb

Script = Callable[[tuple[int, ...]], Sequence[int]]
TOKEN_LOGPROB = -0.25


@dataclass
class _Running:
    script: Sequence[int]
    prompt_len: int
    generated: int
    top_n: int


@dataclass
class ScriptedShardClient:
    """Fake shard group; ``script(prompt_ids)`` gives the ids to emit."""

    script: Script
    num_blocks: int = 256
    block_size: int = 16
    requests: dict[int, _Running] = field(default_factory=dict)
    prefilled: list[pb.Request] = field(default_factory=list)

    async def health(self) -> None:
        """Always healthy."""

    async def close(self) -> None:
        """Nothing to close."""

    def _generation(self, request_id: int) -> pb.Generation:
        running = self.requests[request_id]
        token = running.script[running.generated % len(running.script)]
        running.generated += 1
        tops = [pb.TopToken(token_id=token + i, logprob=TOKEN_LOGPROB - i)
                for i in range(running.top_n)]
        return pb.Generation(request_id=request_id, token_id=token, logprob=TOKEN_LOGPROB,
                             top_tokens=tops)

    async def prefill(self, batch: pb.Batch) -> pb.PrefillResponse:
        generations, kept = [], []
        for request in batch.requests:
            self.prefilled.append(request)
            if request.partial:
                continue
            prompt = tuple(request.input_ids[: len(request.input_ids) - request.num_generated])
            self.requests[request.id] = _Running(
                list(self.script(prompt)), len(prompt), request.num_generated,
                request.top_n_tokens,
            )
            generation = self._generation(request.id)
            if request.prompt_logprobs:
                start = max(request.cache_len, 1)
                generation.prompt_logprobs.extend(
                    -1.0 - i / 100 for i in range(start, len(request.input_ids))
                )
            generations.append(generation)
            kept.append(request.id)
        return pb.PrefillResponse(generations=generations,
                                  batch=pb.CachedBatch(id=batch.id, request_ids=kept))

    async def decode(
        self,
        batches: list[pb.CachedBatch],
        block_appends: dict[int, list[int]],
        remove_request_ids: Sequence[int] = (),
    ) -> pb.DecodeResponse:
        removed = set(remove_request_ids)
        ids = [rid for batch in batches for rid in batch.request_ids if rid not in removed]
        generations = [self._generation(rid) for rid in ids]
        return pb.DecodeResponse(
            generations=[g for g in generations if g.top_tokens],
            batch=pb.CachedBatch(id=batches[0].id, request_ids=ids),
            token_ids=[g.token_id for g in generations],
            logprobs=[g.logprob for g in generations],
        )

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        return pb.CachedBatch(id=batch_id, request_ids=request_ids)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        """Nothing cached."""
