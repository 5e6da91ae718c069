"""The one-pass greedy kernel against the torch ops of ``sample_greedy`` (its reference):
the same argmax, ties to the lowest index as ``torch.argmax``, and logprobs within float
rounding; on CUDA, and in Triton's interpreter elsewhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from shard.kernels.greedy import BLOCK, greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    ids = x.argmax(dim=-1)
    return ids, x.gather(1, ids[:, None]).squeeze(1) - x.logsumexp(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "vocab"), [(1, 49152), (5, BLOCK + 17), (3, 100)])
def test_greedy_kernel_matches_torch(dtype: torch.dtype, batch: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(batch + vocab)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype).to(DEVICE)
    ids, logprobs = greedy(logits)
    want_ids, want_logprobs = _reference(logits)
    assert ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_index_across_tiles() -> None:
    vocab = 3 * BLOCK
    logits = torch.zeros(3, vocab)
    logits[0, [7, BLOCK + 7, 2 * BLOCK + 7]] = 5.0  # the same maximum in three tiles
    logits[1, [BLOCK + 9, BLOCK + 3]] = 5.0  # two inside one tile
    logits[2, vocab - 1] = 5.0  # only in the last tile
    ids, logprobs = greedy(logits.to(DEVICE))
    assert ids.tolist() == [7, BLOCK + 3, vocab - 1]
    torch.testing.assert_close(logprobs, _reference(logits.to(DEVICE))[1], rtol=1e-5, atol=1e-5)


def test_a_strided_view_of_rows() -> None:
    # rows of a wider buffer, as a captured graph's logits buffer is sliced
    buffer = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    view = buffer[:3, :250]
    ids, _ = greedy(view)
    assert torch.equal(ids, view.argmax(dim=-1))


def test_minus_infinity_in_the_first_tiles() -> None:
    # masked-out logits (-inf) filling whole tiles before the first finite one
    logits = torch.randn(2, 3 * BLOCK, generator=torch.Generator().manual_seed(2))
    logits[0, : 2 * BLOCK] = float("-inf")
    logits[1, ::2] = float("-inf")
    ids, logprobs = greedy(logits.to(DEVICE))
    want_ids, want_logprobs = _reference(logits.to(DEVICE))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
