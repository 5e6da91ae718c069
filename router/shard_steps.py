"""The router's side of the shard protocol: scheduler decisions go out as Prefill and
Decode calls, each call's results come back as plain per-token values.

With :mod:`router.shard_client` (the transport) this is the only router code that
builds or reads shard protobuf messages. It also keeps the shards' cached batches as
the router knows them: a prefill leaves one batch of its finished requests on the
shards, and every Decode concatenates them all into one, dropping (in the same call)
the requests that no longer step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Collection
from dataclasses import dataclass, field

from router.request import TopToken
from router.scheduler import PrefillChunk
from router.shard_client import ShardClient
from shard.pb import shard_pb2 as pb


@dataclass(frozen=True)
class TokenExtras:
    """What a token carries besides its id and logprob, when its request asked.

    Attributes:
        top_tokens: The most likely alternatives (``top_n_tokens``).
        prompt_logprobs: With the first token of a request that asked for them: the
            logprob of every prompt token after the first.
    """

    top_tokens: tuple[TopToken, ...]
    prompt_logprobs: tuple[float, ...]


@dataclass
class StepResults:
    """One call's sampled tokens, one entry per request in the order the call listed
    them.

    Attributes:
        token_ids: Sampled ids.
        logprobs: Their log-probabilities (natural log).
        extras: Per token, its extras or None; None as a whole when no request asked.
        forward_s: The shard's forward time of the step, seconds.
        grammar_failures: Request id -> why, for the requests whose grammar failed on
            the shards in this step (their tokens of the step are void).
    """

    token_ids: list[int]
    logprobs: list[float]
    extras: list[TokenExtras | None] | None
    forward_s: float
    grammar_failures: dict[int, str] = field(default_factory=dict)


def _extras(generation: pb.Generation) -> TokenExtras | None:
    if not generation.top_tokens and not generation.prompt_logprobs:
        return None
    return TokenExtras(
        top_tokens=tuple(TopToken(t.token_id, t.logprob) for t in generation.top_tokens),
        prompt_logprobs=tuple(generation.prompt_logprobs),
    )


class ShardSteps:
    """Sends steps to the shard group and reads their results.

    Args:
        client: The shard group.
        block_size: Tokens per KV block.
    """

    def __init__(self, client: ShardClient, block_size: int) -> None:
        self.client = client
        self.block_size = block_size
        self._batches: list[pb.CachedBatch] = []
        self._batch_ids = itertools.count()

    def reset(self, client: ShardClient, block_size: int) -> None:
        """Talk to ``client`` from now on; it holds no batch yet (a new or cleared group)."""
        self.client = client
        self.block_size = block_size
        self._batches = []

    def forget_batches(self) -> None:
        """The shards hold no batch any more (after a failure and ``ClearCache``)."""
        self._batches = []

    def prefill(self, chunks: list[PrefillChunk]) -> asyncio.Future[pb.PrefillResponse]:
        """Send one Prefill of ``chunks`` (call before the scheduler records them as
        prefilled); the requests whose prompt it completes form a new cached batch."""
        batch = pb.Batch(id=next(self._batch_ids),
                         requests=[self._request(chunk) for chunk in chunks])
        task = asyncio.ensure_future(self.client.prefill(batch))
        final = [chunk.seq.id for chunk in chunks if not chunk.partial]
        if final:
            self._batches.append(pb.CachedBatch(id=batch.id, request_ids=final))
        return task

    def decode(
        self, stepping: Collection[int], block_appends: dict[int, list[int]]
    ) -> tuple[asyncio.Future[pb.DecodeResponse], list[int]] | None:
        """Send one Decode over every cached batch, stepping the requests in
        ``stepping``; every other request leaves the shards' batch in the same call.

        Returns:
            The call and the ids it steps, in the order its results come; None when no
            cached request is in ``stepping``.
        """
        held = [rid for batch in self._batches for rid in batch.request_ids]
        kept = [rid for rid in held if rid in stepping]
        if not kept:
            return None
        removed = [rid for rid in held if rid not in stepping]
        task = asyncio.ensure_future(self.client.decode(self._batches, block_appends, removed))
        self._batches = [pb.CachedBatch(id=self._batches[0].id, request_ids=kept)]
        return task, kept

    @staticmethod
    def prefill_results(response: pb.PrefillResponse) -> StepResults:
        """The tokens of a Prefill response, in its requests' order."""
        generations = response.generations
        extras = [_extras(g) for g in generations]
        return StepResults(
            token_ids=[g.token_id for g in generations],
            logprobs=[g.logprob for g in generations],
            extras=extras if any(e is not None for e in extras) else None,
            forward_s=response.timings.forward_ns / 1e9,
            grammar_failures={f.request_id: f.message for f in response.grammar_failures},
        )

    @staticmethod
    def decode_results(response: pb.DecodeResponse) -> StepResults:
        """The tokens of a Decode response (packed ids and logprobs; full generations
        only for the requests that asked for more), in its batch's order."""
        extras: list[TokenExtras | None] | None = None
        if response.generations:
            by_id = {g.request_id: _extras(g) for g in response.generations}
            extras = [by_id.get(rid) for rid in response.batch.request_ids]
        return StepResults(
            token_ids=list(response.token_ids),
            logprobs=list(response.logprobs),
            extras=extras,
            forward_s=response.timings.forward_ns / 1e9,
            grammar_failures={f.request_id: f.message for f in response.grammar_failures},
        )

    async def sync(self, running: Collection[int]) -> None:
        """Drop from the shards' cached batches every request not in ``running``."""
        kept: list[pb.CachedBatch] = []
        for batch in self._batches:
            keep = [rid for rid in batch.request_ids if rid in running]
            if not keep:
                await self.client.clear_cache(batch.id)
            elif len(keep) < len(batch.request_ids):
                kept.append(await self.client.filter_batch(batch.id, keep))
            else:
                kept.append(batch)
        self._batches = kept

    def _request(self, chunk: PrefillChunk) -> pb.Request:
        seq = chunk.seq
        sampling = seq.request.sampling
        return pb.Request(
            id=seq.id,
            input_ids=seq.all_ids()[: chunk.end],
            cache_len=chunk.cache_len,
            block_ids=seq.block_ids[: -(-chunk.end // self.block_size)],
            partial=chunk.partial,
            sampling=pb.SamplingParameters(**sampling.__dict__),
            top_n_tokens=seq.request.top_n_tokens,
            # Prompt logprobs are sent once, with the first token (not after a recompute).
            prompt_logprobs=seq.wants_prompt_logprobs,
            # generated tokens among input_ids: a partial chunk of a recompute after
            # preemption may end inside them, or before them
            num_generated=max(0, chunk.end - len(seq.prompt_ids)),
            grammar=seq.request.grammar,
        )
