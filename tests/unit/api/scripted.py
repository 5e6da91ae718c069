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
    # prefill state: tokens in the cache / all tokens sent, and the request as sent
    computed: int = 0
    total: int = 0
    request: pb.NewRequest | None = None


@dataclass
class ScriptedShardClient:
    """Fake shard group; ``script(prompt_ids)`` gives the ids to emit.

    It keeps the step contract of proto/shard.proto as a shard does (requests held by
    id, decoding rows in order, finished ids that must be held), so a router that
    breaks it fails here with an AssertionError.
    """

    script: Script
    num_blocks: int = 256
    block_size: int = 16
    requests: dict[int, _Running] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)
    prefilled: list[pb.NewRequest] = field(default_factory=list)
    restart: bool = False

    async def health(self) -> None:
        """Always healthy."""

    async def close(self) -> None:
        """Nothing to close."""

    def restart_steps(self) -> None:
        self.restart = True

    def _step(self, finished: Sequence[int]) -> None:
        if self.restart:  # the first step after a failed one: drop what is held
            self.restart = False
            self.requests.clear()
            self.rows.clear()
        for rid in finished:
            assert rid in self.requests, f"finished request {rid} is not held"
            del self.requests[rid]
            if rid in self.rows:
                self.rows.remove(rid)

    def _generation(self, request_id: int) -> pb.Generation:
        running = self.requests[request_id]
        token = running.script[running.generated % len(running.script)]
        running.generated += 1
        tops = [pb.TopToken(token_id=token + i, logprob=TOKEN_LOGPROB - i)
                for i in range(running.top_n)]
        return pb.Generation(request_id=request_id, token_id=token, logprob=TOKEN_LOGPROB,
                             top_tokens=tops)

    async def prefill(self, step: pb.PrefillRequest) -> pb.PrefillResponse:
        self._step(step.finished_request_ids)
        # a mixed step: the rows held before it step first, as in a Decode
        decoded = self._decode_rows(step.row_appends) if step.decode else None
        assert step.decode or not step.row_appends, "row appends without decode"
        computed: list[int] = []
        for cached in step.cached_requests:
            running = self.requests[cached.id]
            assert cached.id not in self.rows, f"request {cached.id} already decodes"
            running.computed = (running.total if cached.num_tokens == 0
                                else running.computed + cached.num_tokens)
            computed.append(cached.id)
        for request in step.new_requests:
            assert request.id not in self.requests, f"new request {request.id} is held"
            self.prefilled.append(request)
            prompt = tuple(request.input_ids[: len(request.input_ids) - request.num_generated])
            total = len(request.input_ids)
            self.requests[request.id] = _Running(
                list(self.script(prompt)), len(prompt), request.num_generated,
                request.top_n_tokens, total=total, request=request,
                computed=(total if request.num_tokens == 0
                          else request.cache_len + request.num_tokens),
            )
            computed.append(request.id)
        generations = []
        for rid in computed:
            running = self.requests[rid]
            if running.computed < running.total:
                continue
            generation = self._generation(rid)
            request = running.request
            assert request is not None
            if request.prompt_logprobs:
                start = max(request.cache_len, 1)
                generation.prompt_logprobs.extend(
                    -1.0 - i / 100 for i in range(start, len(request.input_ids))
                )
            generations.append(generation)
            self.rows.append(rid)
        return pb.PrefillResponse(generations=generations, decode=decoded)

    async def decode(self, step: pb.DecodeRequest, num_rows: int) -> pb.DecodeResponse:
        self._step(step.finished_request_ids)
        assert len(self.rows) == num_rows, f"{len(self.rows)} rows, the router says {num_rows}"
        return self._decode_rows(step.cached_requests)

    def _decode_rows(self, appends: Sequence[pb.CachedRequest]) -> pb.DecodeResponse:
        for cached in appends:
            assert cached.id in self.rows, f"request {cached.id} is not a decoding row"
        assert self.rows, "a step that decodes with no row held"
        generations = [self._generation(rid) for rid in self.rows]
        return pb.DecodeResponse(
            generations=[g for g in generations if g.top_tokens],
            token_ids=[g.token_id for g in generations],
            logprobs=[g.logprob for g in generations],
        )
