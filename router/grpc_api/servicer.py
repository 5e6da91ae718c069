"""``TextGeneration`` servicer: proto message → validated request → engine → proto message.

Parameters mean what they mean on the HTTP API: a proto ``Parameters`` becomes the same
:class:`~router.api.schemas.GenerateParameters` and goes through the same validator.
One place (:func:`_call`) maps exceptions to status codes: bad input INVALID_ARGUMENT
naming the field, a draining server UNAVAILABLE, a full queue RESOURCE_EXHAUSTED, a
failed generation INTERNAL, or UNAVAILABLE when the shutdown cut it (past
``--graceful-timeout``), so that the client retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from router.api.generation import (
    Completion,
    GenerationFailed,
    GrammarFailed,
    MergedStream,
    run_all,
)
from router.api.state import ServerState
from router.api.tgi import token_text
from router.engine.api import QueueFullError, ShuttingDownError
from router.pb import generate_pb2 as pb
from router.pb import generate_pb2_grpc
from router.request import FinishReason, GenerationRequest, TokenEvent
from router.validation import RequestValidationError, parameters_from

T = TypeVar("T")

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


def parameters_dict(message: pb.Parameters) -> dict[str, Any]:
    """The fields set in ``message`` (unset optionals take the HTTP defaults); repeated
    fields as lists, as the strict schema wants."""
    values: dict[str, Any] = {
        field.name: list(value) if field.is_repeated else value
        for field, value in message.ListFields()
    }
    if message.HasField("grammar"):
        grammar = message.grammar
        values["grammar"] = {
            "type": grammar.type, "value": grammar.value,
            **({"strict": grammar.strict} if grammar.HasField("strict") else {}),
        }
    return values


async def _call(
    context: grpc.aio.ServicerContext, work: Awaitable[T], state: ServerState,
    draining: Callable[[], bool],
) -> T:
    """``work``'s result, or the call aborted with the status its exception maps to
    (``draining``: whether the server is shutting down)."""
    try:
        return await work
    except RequestValidationError as error:
        state.engine.count_rejected()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    except ShuttingDownError as error:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
    except QueueFullError as error:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    except GrammarFailed as error:  # the request's own grammar: its input
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    except GenerationFailed as error:
        # failed while the server shuts down (cut at --graceful-timeout, or its shards
        # failed and are not restarted): another replica can serve it
        code = grpc.StatusCode.UNAVAILABLE if draining() else grpc.StatusCode.INTERNAL
        await context.abort(code, str(error))
    raise AssertionError("context.abort returns only by raising")


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    """Serves ``shardserve.generate.v1.TextGeneration`` over ``state``; ``draining``
    says whether the server is shutting down."""

    def __init__(self, state: ServerState,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.state = state
        self.draining = draining
        self.tokenizer = state.engine.tokenizer

    def _validate(self, request: pb.GenerateRequest) -> tuple[GenerationRequest, int]:
        params = parameters_from(parameters_dict(request.parameters), prefix="parameters.")
        validated = self.state.validator.validate(request.inputs, params)
        return validated, params.best_of or 1

    def _token(self, event: TokenEvent, streamed: bool = False) -> pb.Token:
        """``event`` as a token: with the text it released when ``streamed`` (no piece of
        a possible stop string is sent before it is ruled out), else its own text."""
        text = event.text if streamed else event.own_text
        return pb.Token(id=event.id, text=text, logprob=event.logprob,
                        special=event.special)

    def _tops(self, event: TokenEvent) -> list[pb.Token]:
        return [pb.Token(id=t.token_id, text=token_text(self.tokenizer, t.token_id),
                         logprob=t.logprob, special=self.tokenizer.is_special(t.token_id))
                for t in event.top_tokens]

    def _prefill(self, completion: Completion) -> list[pb.Token]:
        if not completion.request.prompt_logprobs:
            return []
        ids = completion.request.input_ids
        logprobs = completion.prompt_logprobs
        tokens = [pb.Token(id=ids[0], text=token_text(self.tokenizer, ids[0]))]
        for i, token_id in enumerate(ids[1:]):
            token = pb.Token(id=token_id, text=token_text(self.tokenizer, token_id))
            if i < len(logprobs):
                token.logprob = logprobs[i]
            tokens.append(token)
        return tokens

    @staticmethod
    def _ending(completion: Completion, prefix: str) -> dict[str, Any]:
        """The fields that end a sequence, in ``Sequence`` and in a stream's last
        message alike: text, finish reason, token count and seed."""
        assert completion.finish is not None, "a generation ended without a finish"
        fields: dict[str, Any] = {
            "generated_text": prefix + completion.text,
            "finish_reason": _FINISH[completion.finish.reason],
            "generated_tokens": completion.finish.generated_tokens,
        }
        if completion.seed is not None:
            fields["seed"] = completion.seed
        return fields

    def _sequence(self, completion: Completion, prefix: str) -> pb.Sequence:
        sequence = pb.Sequence(
            prefill=self._prefill(completion),
            tokens=[self._token(e) for e in completion.tokens],
            **self._ending(completion, prefix),
        )
        if completion.request.top_n_tokens:
            sequence.top_tokens.extend(pb.TopTokens(tokens=self._tops(e))
                                       for e in completion.tokens)
        return sequence

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        """One completion; best_of > 1 returns the most likely of best_of samples."""

        async def work() -> pb.GenerateResponse:
            validated, best_of = await self.state.offload.run(self._validate, request)
            requests = self.state.validator.fan_out(validated, best_of)
            done = await run_all(self.state.engine, requests)
            done.sort(key=lambda c: c.logprob_sum, reverse=True)
            prefix = request.inputs if request.parameters.return_full_text else ""
            return pb.GenerateResponse(
                sequence=self._sequence(done[0], prefix),
                best_of_sequences=[self._sequence(c, prefix) for c in done[1:]],
            )

        return await _call(context, work(), self.state, self.draining)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """One message per generated token; the last carries the text and finish."""
        def validate() -> tuple[GenerationRequest, int]:
            validated, best_of = self._validate(request)
            if best_of > 1:
                raise RequestValidationError("parameters.best_of",
                                             "best_of > 1 is not supported when streaming")
            return validated, best_of

        validated, _ = await _call(context, self.state.offload.run(validate), self.state,
                                   self.draining)
        prefix = request.inputs if request.parameters.return_full_text else ""
        completion = Completion(validated)
        async with MergedStream(self.state.engine, [validated]) as stream:
            events = aiter(stream)
            while (item := await _call(context, anext(events, None), self.state,
                                       self.draining)) is not None:
                event = item[1]
                completion.tokens.append(event)
                completion.finish = event.finish
                yield pb.GenerateStreamResponse(
                    token=self._token(event, streamed=True),
                    top_tokens=self._tops(event),
                    prefill=self._prefill(completion) if len(completion.tokens) == 1 else [],
                    **(self._ending(completion, prefix) if event.finish is not None else {}),
                )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        """Token ids, texts and character offsets of ``inputs``."""

        def answer() -> pb.TokenizeResponse:
            encoding = self.state.validator.tokenize(request.inputs, request.add_special_tokens)
            return pb.TokenizeResponse(
                tokens=[pb.Token(id=i, text=token_text(self.tokenizer, i),
                                 special=self.tokenizer.is_special(i)) for i in encoding.ids],
                starts=[start for start, _ in encoding.offsets],
                stops=[stop for _, stop in encoding.offsets],
            )

        # Tokenizing and building the answer (one entry per token) run off the event loop.
        return await _call(context, self.state.offload.run(answer), self.state,
                           self.draining)

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfoResponse:
        """Model and limits, as ``GET /info``."""
        state = self.state
        limits = state.validator.limits
        return pb.ModelInfoResponse(
            model_id=state.model_id, model_dtype=state.dtype,
            model_device_type=state.device_type, num_shard=state.num_shard,
            max_input_tokens=state.engine.config.max_input_tokens,
            max_total_tokens=state.engine.config.max_total_tokens,
            max_best_of=limits.max_best_of, max_stop_sequences=limits.max_stop_sequences,
            max_top_n_tokens=limits.max_top_n_tokens, version=state.version,
        )
