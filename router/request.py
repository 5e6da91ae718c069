"""Typed request state shared by validation, the scheduler and the engine."""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from array import array
from dataclasses import dataclass, field

from router.acceptance import SpeculationStats
from shard.sampling_types import SamplingParams, TopToken


class FinishReason(enum.StrEnum):
    """Why a sequence ended (TGI's names)."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    PREFILLING = "prefilling"  # admitted, prompt partly prefilled (chunked prefill)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StoppingParams:
    """When to stop: token budget, stop strings, stop token ids."""

    max_new_tokens: int = 20
    stop_sequences: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A validated, tokenized request ready for the scheduler."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    top_n_tokens: int = 0
    prompt_logprobs: bool = False
    # llguidance grammar (JSON text) the output must follow, checked by router.grammar;
    # "" = unconstrained. Validation turns ignore_eos off for a constrained request: EOS
    # is the only token a complete grammar allows.
    grammar: str = ""
    # False: the caller needs only the whole answer, so the engine hands over the
    # token events together when the request ends (one wake-up instead of one per token).
    stream: bool = True
    # False: the caller reads only the whole text, not each token's: a request without
    # stop strings then has its text decoded once, at the end, and carried by its last
    # event (the others have ''), instead of being detokenized token by token.
    token_texts: bool = True


@dataclass(frozen=True)
class Finish:
    """End of a sequence, carried by its last token."""

    reason: FinishReason
    generated_tokens: int
    stop_sequence: str | None = None


@dataclass(slots=True)  # one per token per request: slots, not frozen, for speed
class TokenEvent:
    """One generated token.

    Attributes:
        text: Text released with this token: its own text, or '' while it may still be
            part of a stop string, or several tokens' held text at once. Joined over a
            sequence's events: its generated text.
        finish: Set on the last token of the sequence.
        prompt_logprobs: On the first token of a request with ``prompt_logprobs``: the
            logprob of every prompt token after the first (``len(prompt) - 1`` values).
        token_text: The token's own text where ``text`` differs from it (text held back
            or released for a stop string, or cut after one); None: ``text`` is it.
    """

    id: int
    logprob: float
    text: str
    special: bool
    top_tokens: tuple[TopToken, ...] = ()
    finish: Finish | None = None
    prompt_logprobs: tuple[float, ...] = ()
    token_text: str | None = None

    @property
    def own_text(self) -> str:
        """The token's own text, whatever a stop string held back or released with it:
        a whole answer's ``details.tokens[].text`` and what OpenAI's ``text_offset``
        counts. A stream's pieces are :attr:`text` instead, so that no piece of a possible
        stop string is sent before it is ruled out."""
        return self.text if self.token_text is None else self.token_text


class Refusal(enum.Enum):
    """Why an engine refused a request at submission (see ``router.engine.submit``)."""

    QUEUE_FULL = "queue_full"
    SHUTTING_DOWN = "shutting_down"


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed after it was accepted (for example a shard died), or, with
    ``refusal`` set, was refused at submission by an engine in another process (whose
    refusal reaches the API process as the stream's only event). ``grammar`` marks a
    failure of the request's own grammar (its input), not of the server."""

    message: str
    refusal: Refusal | None = None
    grammar: bool = False


@dataclass(eq=False)
class HeldAnswer:
    """The token events of a request that does not stream, held until it ends and handed
    over as one item (``GenerationRequest.stream`` False).

    Kept as columns of plain values (ids, logprobs, special flags; the texts that are not
    empty, by position) plus the events that carry more (alternatives, prompt logprobs,
    the finish) by position: a whole answer of 512 tokens is a handful of objects, not
    512 events. So the garbage collector has no per-token objects to scan while the
    engine holds it, it pickles in one pass to an API process, and a reader that needs
    only the text, the finish and the logprob sum never builds the events.
    """

    ids: array = field(default_factory=lambda: array("q"))  # int64 token ids
    logprobs: array = field(default_factory=lambda: array("d"))  # float64, nats
    texts: dict[int, str] = field(default_factory=dict)  # position -> text, if not ''
    specials: bytearray = field(default_factory=bytearray)  # 1: a special token
    rich: dict[int, TokenEvent] = field(default_factory=dict)  # position -> event

    def append(self, event: TokenEvent) -> None:
        """Hold ``event`` after the others."""
        if (event.top_tokens or event.prompt_logprobs or event.finish is not None
                or event.token_text is not None):
            self.rich[len(self.ids)] = event
        if event.text:
            self.texts[len(self.ids)] = event.text
        self.ids.append(event.id)
        self.logprobs.append(event.logprob)
        self.specials.append(event.special)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def finish(self) -> Finish | None:
        """The last event's finish (None until the last is held)."""
        last = self.rich.get(len(self.ids) - 1)
        return last.finish if last is not None else None

    def event(self, index: int) -> TokenEvent:
        """The event held at ``index``, as it was put."""
        rich = self.rich.get(index)
        if rich is not None:
            return rich
        return TokenEvent(self.ids[index], self.logprobs[index], self.texts.get(index, ""),
                          bool(self.specials[index]))

    def events(self) -> list[TokenEvent]:
        """Every event held, in order."""
        return [self.event(i) for i in range(len(self.ids))]

    @property
    def text(self) -> str:
        """The texts released with the events, joined."""
        return "".join(self.texts.values())

    @property
    def logprob_sum(self) -> float:
        """The events' logprobs summed in order (as ``sum`` over the events would)."""
        return sum(self.logprobs)


Event = TokenEvent | ErrorEvent
# What a sequence's EventStream carries: its events, or its whole answer at once.
StreamItem = Event | HeldAnswer


class EventStream:
    """The events of one sequence, from the engine (producer) to one reader.

    A lighter ``asyncio.Queue``: a deque and at most one waiting reader, woken once
    however many events arrive before it runs (every running sequence gets an event per
    decode step, so this is on the hot path).
    """

    def __init__(self) -> None:
        self._events: collections.deque[StreamItem] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, event: Event) -> None:
        """Append ``event`` and wake the reader."""
        self._put(event)

    def _put(self, item: StreamItem) -> None:
        self._events.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def put_all(self, events: list[Event]) -> None:
        """Append ``events`` in order and wake the reader once."""
        if not events:
            return
        self._events.extend(events)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def put_answer(self, held: HeldAnswer) -> None:
        """Append a whole answer (:attr:`Sequence.held`) as one item and wake the reader;
        :meth:`router.engine.EventSource.generate` yields its events one by one,
        ``run_all`` takes it whole."""
        self._put(held)

    def empty(self) -> bool:
        return not self._events

    def peek(self) -> StreamItem:
        """The oldest event, left in place. Raises ``IndexError`` when there is none."""
        return self._events[0]

    def get_nowait(self) -> StreamItem:
        """The oldest event. Raises ``IndexError`` when there is none."""
        return self._events.popleft()

    async def get(self) -> StreamItem:
        """The oldest event, waiting for one."""
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._events.popleft()


@dataclass(eq=False)
class Sequence:
    """Router-side state of one request being generated.

    ``prompt_ids + output_ids`` are all tokens so far; every one of them but the last is
    in the KV cache while the sequence runs, and its blocks hold them all before a step.
    """

    id: int
    request: GenerationRequest
    events: EventStream = field(default_factory=EventStream)
    output_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens of all_ids() whose K/V are in the cache (prefix hits + prefilled chunks);
    # only meaningful while waiting or prefilling.
    num_computed: int = 0
    # Prefix-cache digests of the full blocks of all_ids() hashed so far (the scheduler
    # extends them as the sequence grows, so each block is hashed once).
    block_hashes: list[bytes] = field(default_factory=list)
    cancelled: bool = False
    # Tokens sampled by shard calls sent but not yet processed (overlapped scheduling):
    # the cache holds num_tokens + pending_tokens - 1 tokens once they are computed.
    pending_tokens: int = 0
    # Bumped on preemption: results of calls sent before it no longer apply.
    epoch: int = 0
    # Token events held back until the end (requests with stream=False), see
    # OutputProcessor.deliver; None until the first.
    held: HeldAnswer | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    admitted_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # its guesses and their acceptance, with speculative decoding
    speculation: SpeculationStats = field(default_factory=SpeculationStats)

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.input_ids

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.request.input_ids) + len(self.output_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to be computed (asked for, and not yet delivered with a
        first token): they need the whole prompt computed in one prefill."""
        return self.request.prompt_logprobs and not self.output_ids

    def all_ids(self) -> list[int]:
        """Prompt plus generated token ids (what a recompute after preemption prefills)."""
        return [*self.request.input_ids, *self.output_ids]
