"""Output processing: each sampled token becomes its request's next stream event.

Per token: detokenize incrementally, check EOS, stop token ids, stop strings and the
length limits, decide the finish, and queue the :class:`~router.request.TokenEvent`.
Events are delivered to the streams in batches (:meth:`OutputProcessor.deliver`), once
the engine has sent the next shard call, so that the stream handlers write while the
shards compute. A request that does not stream gets its events together at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.detokenizer import IncrementalDetokenizer, generated_text
from router.request import Finish, FinishReason, HeldAnswer, Sequence, TokenEvent
from router.scheduler import Scheduler
from router.shard_steps import TokenExtras
from router.stop import StopSequenceChecker
from router.tokenizer import Tokenizer


@dataclass
class _TextState:
    # None: the text is decoded once, at the end (GenerationRequest.token_texts)
    detokenizer: IncrementalDetokenizer | None
    stop: StopSequenceChecker


class OutputProcessor:
    """Text and finish decisions of the running requests.

    Args:
        tokenizer: The model's tokenizer (detokenization, EOS and special ids).
        scheduler: The engine's scheduler, whose budgets (``max_total_tokens``: prompt
            plus generated tokens at which a request ends) follow each restart.
    """

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self._scheduler = scheduler
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._special = tokenizer.special_ids
        self._text: dict[int, _TextState] = {}
        self._outbox: list[tuple[Sequence, TokenEvent]] = []

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._text

    def add(self, seq: Sequence) -> None:
        """Start tracking ``seq`` (its prompt gives the detokenizer its context)."""
        request = seq.request
        per_token = request.token_texts or bool(request.stopping.stop_sequences)
        self._text[seq.id] = _TextState(
            detokenizer=(IncrementalDetokenizer(self.tokenizer, list(request.input_ids))
                         if per_token else None),
            stop=StopSequenceChecker(list(request.stopping.stop_sequences)),
        )

    def remove(self, seq_id: int) -> None:
        """Forget a finished, cancelled or failed sequence (no-op when unknown)."""
        self._text.pop(seq_id, None)

    def on_token(
        self, seq: Sequence, token_id: int, logprob: float, extras: TokenExtras | None
    ) -> Finish | None:
        """Queue the event of ``token_id``, already appended to ``seq.output_ids``;
        return how the sequence finished with it, or None while it goes on.

        Stop strings end the text with the stop string (TGI's semantics; the OpenAI
        layer strips it); text that could begin a stop string is held back until ruled
        out, so that the streamed text always equals the final text.
        """
        state = self._text[seq.id]
        stopping = seq.request.stopping
        reason: FinishReason | None = None
        stop_text: str | None = None
        if token_id in self._eos and not stopping.ignore_eos:
            reason = FinishReason.EOS_TOKEN
        elif stopping.stop_token_ids and token_id in stopping.stop_token_ids:
            reason = FinishReason.STOP_SEQUENCE
            stop_text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        detokenizer = state.detokenizer
        own: str | None = None  # the token's own text, where stop strings are checked
        if detokenizer is None:
            text, match = "", None
        elif stopping.stop_sequences:
            own = detokenizer.add(token_id)
            text, match = state.stop.feed(own)
        else:
            text, match = detokenizer.add(token_id), None
        generated = len(seq.output_ids)
        if match is None and reason is None and (
            generated >= stopping.max_new_tokens
            or generated + len(seq.request.input_ids)
            >= self._scheduler.config.max_total_tokens
        ):
            reason = FinishReason.LENGTH
        if detokenizer is None:
            if reason is not None:
                text = generated_text(self.tokenizer, seq.request.input_ids, seq.output_ids)
        elif match is None and reason is not None:
            tail = detokenizer.flush()
            if own is None:
                text += tail
            else:
                own += tail
                more, match = state.stop.feed(tail)
                text += more if match is not None else more + state.stop.flush()
        if match is not None:
            reason, stop_text = FinishReason.STOP_SEQUENCE, match.stop
            text += match.stop
        finish = None
        if reason is not None:
            finish = Finish(reason, generated_tokens=generated, stop_sequence=stop_text)
        self._outbox.append((seq, TokenEvent(
            id=token_id,
            logprob=logprob,
            text=text,
            special=token_id in self._special,
            top_tokens=() if extras is None else extras.top_tokens,
            finish=finish,
            prompt_logprobs=() if extras is None else extras.prompt_logprobs,
            token_text=None if own == text else own,
        )))
        return finish

    def deliver(self) -> None:
        """Put the queued events on their sequences' streams, in order; nothing reaches
        a stream after its cancellation."""
        outbox, self._outbox = self._outbox, []
        for seq, event in outbox:
            if seq.cancelled:
                continue
            if seq.request.stream:
                seq.events.put_nowait(event)
                continue
            held = seq.held
            if held is None:
                held = seq.held = HeldAnswer()
            held.append(event)
            if event.finish is not None:
                seq.events.put_answer(held)
                seq.held = None
