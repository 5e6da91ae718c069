"""Speculative decoding's verify step laid out as a decode step
(:meth:`~shard.speculative.step.SpeculativeDecoder.verify_logits`): sequence i's last
token and m_i guesses become m_i + 1 decode rows that share its block table, row (i, j)
at position ``L_i + j`` with ``seq_lens = L_i + j + 1``, and every row's K/V is written
before any row attends. Through each backend that runs here (torch on both of its
paths; triton, on the CPU in Triton's interpreter; flash_attn and flashinfer on a GPU
where installed) that step must give what the torch reference's varlen prefill gives
over the same tokens with the cached prefix (causal within the m_i + 1 tokens), and
leave the same K/V in the cache.

Contexts of different lengths, some of whose guesses cross a block boundary, m_i from 0
to 4, randomly permuted block tables (:func:`make_case`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.kernels.paged_cases import PagedCase, make_case, reference, rel_error
from shard.attention import AttentionBackend, AttentionSpec, get_backend_class
from shard.attention.metadata import AttentionMetadata
from shard.attention.torch_backend import TorchAttentionBackend
from shard.decode_state import DecodeRows
from shard.kv_cache import KVCacheLayer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
FP32_TOL = 1e-5 if DEVICE == "cpu" else 1e-4  # as tests/kernels/test_triton_kernels.py
# guesses m_i per sequence, and the cached context L_i in blocks + tokens: the 1st and
# 4th sequences' guesses cross into their next block
GUESSES = [3, 0, 4, 2, 4, 1]
CACHED = [(1, -2), (0, 5), (2, 1), (1, -1), (0, 1), (3, -3)]
BACKENDS = ["torch-by-sequence", "torch-batched", "triton", "flash_attn", "flashinfer"]


def _backend(name: str) -> tuple[AttentionBackend, int, torch.dtype, float]:
    """(backend, block size, dtype, tolerance) for ``name``; skip where it cannot run."""
    if name.startswith("torch"):
        torch_backend = TorchAttentionBackend(by_sequence=name == "torch-by-sequence")
        return torch_backend, 16, torch.float32, FP32_TOL
    if name == "triton":  # the CPU runs it in the interpreter (tests/kernels/conftest.py)
        pytest.importorskip("triton")
        return get_backend_class(name)(), 16, torch.float32, FP32_TOL
    cls = get_backend_class(name)
    block_size = cls.kv_block_size(16)
    spec = AttentionSpec(
        torch.device(DEVICE), torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM, block_size
    )
    ok, reason = cls.supports(spec)
    if not ok:
        pytest.skip(f"{name}: {reason}")
    return cls(), block_size, torch.bfloat16, 1e-2  # as tests/kernels/test_gpu_backends.py


def _verify_case(block_size: int, dtype: torch.dtype, seed: int) -> PagedCase:
    """Sequence i: L_i cached tokens, then its m_i + 1 query tokens as one varlen
    prefill chunk (the reference's layout)."""
    cached = [blocks * block_size + extra for blocks, extra in CACHED]
    return make_case(
        [c + m + 1 for c, m in zip(cached, GUESSES, strict=True)],
        [m + 1 for m in GUESSES],
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        block_size,
        dtype,
        DEVICE,
        seed=seed,
    )


def verify_rows(case: PagedCase, offsets: bool = True) -> AttentionMetadata:
    """The decode-step metadata of ``case``'s query tokens, one row each, as
    ``verify_logits`` builds it: sequence i's block table and cached length L_i for each
    of its rows, row j at position L_i + j (``offsets=False``: all at L_i, wrongly)."""
    md = case.metadata
    device = md.seq_lens.device
    q_lens = torch.tensor([m + 1 for m in GUESSES], device=device)
    owner = torch.repeat_interleave(torch.arange(len(GUESSES), device=device), q_lens)
    j = torch.cat([torch.arange(m + 1, device=device) for m in GUESSES])
    cached = (md.seq_lens - q_lens).index_select(0, owner)
    rows = DecodeRows(
        tokens=torch.zeros(len(owner), dtype=torch.int64, device=device),
        seq_lens=(cached + (j if offsets else 0)).to(torch.int32),
        block_tables=md.block_tables.index_select(0, owner),
    )
    return rows.model_inputs(md.block_size, md.max_seqlen_k).metadata


def _run(
    backend: AttentionBackend, case: PagedCase, metadata: AttentionMetadata
) -> tuple[torch.Tensor, KVCacheLayer]:
    cache = case.fresh_cache()
    backend.prepare(metadata)
    return backend.forward(case.q, case.k, case.v, cache, metadata, case.scale), cache


@pytest.mark.parametrize("name", BACKENDS)
def test_verify_rows_attend_as_the_varlen_prefill(name: str) -> None:
    backend, block_size, dtype, tol = _backend(name)
    case = _verify_case(block_size, dtype, seed=len(name))
    ref, ref_cache = reference(case)
    rows = verify_rows(case)
    assert not rows.is_prefill and rows.num_tokens == sum(GUESSES) + len(GUESSES)
    assert torch.equal(rows.slot_mapping, case.metadata.slot_mapping)
    out, cache = _run(backend, case, rows)
    assert out.dtype == dtype and not torch.isnan(out).any()
    err = rel_error(out, ref)
    assert err < tol, f"relative error {err:.2e}"
    assert torch.equal(cache.key, ref_cache.key.to(dtype))
    assert torch.equal(cache.value, ref_cache.value.to(dtype))


def test_rows_not_offset_by_their_guess_attend_otherwise() -> None:
    """The comparison above sees a layout error: rows of one sequence whose seq_lens
    are all L_i + 1 attend to the same context (slots right, the output not), and rows
    all at position L_i write one slot."""
    case = _verify_case(16, torch.float32, seed=1)
    ref, ref_cache = reference(case)
    rows, flat = verify_rows(case), verify_rows(case, offsets=False)
    same_lens = dataclasses.replace(rows, seq_lens=flat.seq_lens, cu_seqlens_k=flat.cu_seqlens_k)
    out, cache = _run(TorchAttentionBackend(), case, same_lens)
    assert torch.equal(cache.key, ref_cache.key)
    assert rel_error(out, ref) > 0.1
    _, cache = _run(TorchAttentionBackend(), case, flat)
    assert not torch.equal(cache.key, ref_cache.key)
