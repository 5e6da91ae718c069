"""The router's side of the step contract (proto/shard.proto): scheduler decisions go
out as Prefill and Decode calls, each call's results come back as plain per-token
values.

With :mod:`router.shard_client` (the transport) this is the only router code that
builds or reads shard protobuf messages. A request goes to the shards once in full
(its first prefill chunk); afterwards a step names it only by id with what changed
(a further chunk, new blocks), and once it is finished, cancelled or preempted its id
leaves with the next step. What is kept here is what the contract needs: which ids the
shards hold, the decoding rows' order (the order of a Decode's tokens) and the ids
waiting to leave.
"""

from __future__ import annotations

import asyncio
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
        num_tokens: A speculative step's tokens per request, in order (``token_ids``
            holds each request's tokens in turn); None: one token per request.
        num_proposed: A speculative step's guesses per request; None without.
        propose_s: A speculative step's time to propose its guesses (part of
            ``forward_s``), seconds.
    """

    token_ids: list[int]
    logprobs: list[float]
    extras: list[TokenExtras | None] | None
    forward_s: float
    grammar_failures: dict[int, str] = field(default_factory=dict)
    num_tokens: list[int] | None = None
    num_proposed: list[int] | None = None
    propose_s: float = 0.0


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
    """

    def __init__(self, client: ShardClient) -> None:
        self.client = client
        self._held: set[int] = set()  # request ids the shards hold
        self._rows: list[int] = []  # the decoding rows, in row order
        self._finished: list[int] = []  # held ids that leave with the next step

    def reset(self, client: ShardClient) -> None:
        """Talk to ``client`` from now on; it holds no request yet (a new group)."""
        self.client = client
        self.restart()

    def restart(self) -> None:
        """Abandon the steps sent so far (after a failed step): before the next one,
        every rank drops what it holds."""
        self.client.restart_steps()
        self._held.clear()
        self._rows = []
        self._finished = []

    def release(self, request_id: int) -> None:
        """``request_id`` is finished, cancelled or preempted: it leaves the shards
        with the next step (nothing to do when they do not hold it)."""
        if request_id in self._held:
            self._held.discard(request_id)
            self._finished.append(request_id)
            if request_id in self._rows:
                self._rows.remove(request_id)

    def prefill(
        self, chunks: list[PrefillChunk], stepping: Collection[int] = (),
        block_appends: dict[int, list[int]] | None = None,
    ) -> tuple[asyncio.Future[pb.PrefillResponse], list[int]]:
        """Send one Prefill of ``chunks`` (as :meth:`Scheduler.schedule` gave them): a
        request the shards hold continues by id, a new one comes in full with the block
        table its chunk was scheduled with. The requests whose prompt it completes
        become decoding rows.

        With ``stepping`` it is a mixed step: the rows in ``stepping`` also compute a
        token, after ``block_appends`` (row id -> new block ids), and every other row
        leaves the shards in the same call, as in :meth:`decode`.

        Returns:
            The call, and the ids it samples a token for, in the order of its results
            (:meth:`prefill_results`): the rows stepped (row order), then the requests
            whose first token it samples.
        """
        rows = self._step_rows(stepping) if stepping else []
        cached = [chunk for chunk in chunks if chunk.seq.id in self._held]
        new = [chunk for chunk in chunks if chunk.seq.id not in self._held]
        request = pb.PrefillRequest(
            finished_request_ids=self._take_finished(),
            cached_requests=[
                pb.CachedRequest(id=c.seq.id, num_tokens=0 if not c.partial else c.num_tokens)
                for c in cached
            ],
            new_requests=[self._new_request(chunk) for chunk in new],
            decode=bool(rows),
            row_appends=_appends(block_appends) if rows else (),
        )
        task = asyncio.ensure_future(self.client.prefill(request))
        self._held.update(chunk.seq.id for chunk in new)
        final = [chunk.seq.id for chunk in (*cached, *new) if not chunk.partial]
        self._rows.extend(final)
        return task, rows + final

    def decode(
        self, stepping: Collection[int], block_appends: dict[int, list[int]],
        guesses: dict[int, int] | None = None,
    ) -> tuple[asyncio.Future[pb.DecodeResponse], list[int]] | None:
        """Send one Decode stepping the rows in ``stepping``; every other row leaves the
        shards in the same call. With ``guesses`` (row id -> most guesses, some > 0) it is
        a speculative step: ``num_speculative_tokens`` is the largest, and a row allowed
        fewer says so in its cached request (``num_tokens`` = 1 + its guesses).

        Returns:
            The call and the ids it steps, in the order its results come; None when no
            row is in ``stepping`` (the ids that leave go with the next step).
        """
        rows = self._step_rows(stepping)
        if not rows:
            return None
        cached = _appends(block_appends)
        k = max(guesses.values()) if guesses else 0
        if k:
            assert guesses is not None
            bounds = {rid: n + 1 for rid, n in guesses.items() if n < k}
            for c in cached:
                c.num_tokens = bounds.pop(c.id, 0)
            cached.extend(pb.CachedRequest(id=rid, num_tokens=n) for rid, n in bounds.items())
        request = pb.DecodeRequest(
            finished_request_ids=self._take_finished(),
            cached_requests=cached,
            num_speculative_tokens=k,
        )
        return asyncio.ensure_future(self.client.decode(request, len(rows))), rows

    def _step_rows(self, stepping: Collection[int]) -> list[int]:
        """The rows a step computes (row order): those in ``stepping``; the others are
        released (they leave the shards with the step)."""
        for rid in [rid for rid in self._rows if rid not in stepping]:
            self.release(rid)
        return list(self._rows)

    def _take_finished(self) -> list[int]:
        finished, self._finished = self._finished, []
        return finished

    @staticmethod
    def prefill_results(response: pb.PrefillResponse, sampled: list[int] | None = None
                        ) -> StepResults:
        """The tokens of a Prefill response, in its requests' order; a mixed step's
        rows first, as :meth:`prefill` listed them (``sampled``: that list of ids,
        needed only when the response has the rows' full generations)."""
        generations = response.generations
        extras = [_extras(g) for g in generations]
        results = StepResults(
            token_ids=[g.token_id for g in generations],
            logprobs=[g.logprob for g in generations],
            extras=extras if any(e is not None for e in extras) else None,
            forward_s=response.timings.forward_ns / 1e9,
            grammar_failures={f.request_id: f.message for f in response.grammar_failures},
        )
        if not response.HasField("decode"):
            return results
        rows = (sampled or [])[: len(response.decode.token_ids)]
        decoded = ShardSteps.decode_results(response.decode, rows)
        if decoded.extras is not None or results.extras is not None:
            results.extras = ((decoded.extras or [None] * len(decoded.token_ids))
                              + (results.extras or [None] * len(results.token_ids)))
        results.token_ids = decoded.token_ids + results.token_ids
        results.logprobs = decoded.logprobs + results.logprobs
        return results

    @staticmethod
    def decode_results(response: pb.DecodeResponse, rows: list[int]) -> StepResults:
        """The tokens of a Decode response (packed ids and logprobs; full generations
        only for the requests that asked for more), in row order; ``rows``: the ids it
        stepped, in row order (needed only when the response has full generations). A
        speculative step's tokens come row after row, ``num_tokens`` of each."""
        counts = list(response.num_tokens) or None
        extras: list[TokenExtras | None] | None = None
        if response.generations:
            by_id: dict[int, list[TokenExtras | None]] = {}
            for g in response.generations:
                by_id.setdefault(g.request_id, []).append(_extras(g))
            extras = []
            for index, rid in enumerate(rows):
                own = by_id.get(rid, [])
                extras.extend(own or [None] * (1 if counts is None else counts[index]))
        return StepResults(
            token_ids=list(response.token_ids),
            logprobs=list(response.logprobs),
            extras=extras,
            forward_s=response.timings.forward_ns / 1e9,
            grammar_failures={f.request_id: f.message for f in response.grammar_failures},
            num_tokens=counts,
            num_proposed=list(response.num_proposed) or None,
            propose_s=response.timings.propose_ns / 1e9,
        )

    def _new_request(self, chunk: PrefillChunk) -> pb.NewRequest:
        seq = chunk.seq
        sampling = seq.request.sampling
        return pb.NewRequest(
            id=seq.id,
            input_ids=seq.all_ids(),
            cache_len=chunk.cache_len,
            block_ids=chunk.block_ids,  # as scheduled (see PrefillChunk)
            num_tokens=chunk.num_tokens if chunk.partial else 0,
            sampling=pb.SamplingParameters(
                temperature=sampling.temperature, top_k=sampling.top_k,
                top_p=sampling.top_p, typical_p=sampling.typical_p, min_p=sampling.min_p,
                do_sample=sampling.do_sample, seed=sampling.seed,
                repetition_penalty=sampling.repetition_penalty,
                frequency_penalty=sampling.frequency_penalty,
                presence_penalty=sampling.presence_penalty,
            ),
            top_n_tokens=seq.request.top_n_tokens,
            # Prompt logprobs are sent once, with the first token (not after a recompute).
            prompt_logprobs=seq.wants_prompt_logprobs,
            # generated tokens among input_ids, after a preemption
            num_generated=len(seq.output_ids),
            grammar=seq.request.grammar,
        )


def _appends(block_appends: dict[int, list[int]] | None) -> list[pb.CachedRequest]:
    """Rows whose block table grows, as a step lists them."""
    return [pb.CachedRequest(id=rid, new_block_ids=blocks)
            for rid, blocks in (block_appends or {}).items()]
