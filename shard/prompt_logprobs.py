"""Prompt logprobs: the log-probability of each prompt token under the model, from the
logits of the token before it, computed in the prefill forward that caches the prompt.

A request that asks for them and has a cached prefix recomputes the last cached token
(its K/V is not written again): its logits give the first new token's logprob.
"""

from __future__ import annotations

import torch

from shard.inputs import ModelInputs, SeqChunk
from shard.models.base import CausalLM
from shard.records import NewRequest


def prefill_chunk(r: NewRequest) -> SeqChunk:
    """The tokens a prefill computes for the new request ``r``: ``input_ids[cache_len:end]``,
    from one token earlier when it asks for prompt logprobs over a cached prefix (that
    token is recomputed, not rewritten: ``write_from`` stays ``cache_len``)."""
    start = r.cache_len
    if r.prompt_logprobs and r.cache_len > 0:
        start -= 1
    return SeqChunk(r.input_ids[start:r.end], start, r.block_ids, write_from=r.cache_len)


def prompt_logprobs(
    model: CausalLM, chunk: SeqChunk, index: int, inputs: ModelInputs, hidden: torch.Tensor
) -> tuple[float, ...]:
    """Logprobs of ``chunk.token_ids[1:]`` (the request's ``input_ids[max(cache_len, 1):]``,
    see :func:`prefill_chunk`), each from the logits of the token before it.

    Args:
        model: the model whose LM head gives the logits.
        chunk: the request's chunk, sequence ``index`` of the forward's ``inputs``.
        hidden: the forward's hidden states [num_tokens, hidden_size].

    Returns:
        one logprob per token after the chunk's first (empty for a one-token chunk).
    """
    if len(chunk.token_ids) < 2:
        return ()
    first = int(inputs.metadata.cu_seqlens_q[index])
    rows = hidden[first : first + len(chunk.token_ids) - 1]
    logprobs = model.compute_logits(rows).log_softmax(dim=-1)
    targets = torch.tensor(chunk.token_ids[1:], dtype=torch.int64, device=logprobs.device)
    return tuple(logprobs.gather(1, targets[:, None]).squeeze(1).tolist())
