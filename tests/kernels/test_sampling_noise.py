"""The sampler's noise on CUDA (skipped elsewhere): the counter-based hash over the whole
batch gives the same draws on the GPU as on the CPU for the same (seed, step), and a
seeded row's token does not depend on the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from shard.sampling import (
    SamplingParams,
    SamplingRow,
    counter_noise,
    exponential_noise,
    row_seed,
    sample,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_noise_is_the_counter_hash() -> None:
    rows = [SamplingRow(SamplingParams(do_sample=True, seed=seed), step=seed % 5)
            for seed in range(16)]
    gpu = exponential_noise(rows, 49152, torch.device("cuda"))
    keys = torch.tensor([row_seed(r.params.seed, r.step) for r in rows], dtype=torch.int64)
    torch.testing.assert_close(gpu.cpu(), counter_noise(keys, 49152), rtol=1e-6, atol=0)


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 49152, device="cuda")
    rows = [SamplingRow(SamplingParams(do_sample=True, seed=100 + i, temperature=0.9), step=2)
            for i in range(8)]
    together = sample(logits, rows).token_ids.tolist()
    alone = [sample(logits[i:i + 1], rows[i:i + 1]).token_ids.item() for i in range(8)]
    assert together == alone
