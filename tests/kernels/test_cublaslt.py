"""cuBLASLt products with a chosen algorithm (:mod:`shard.layers.cublaslt`) against
``F.linear``, and the warm-up tuning that picks them (:mod:`shard.layers.gemm_tuning`).

CPU: the tuning's bookkeeping (row counts, lookup, the flag); GPU: every candidate and
variant cuBLASLt offers gives ``F.linear``'s product, a tuned linear layer gives the same
output as without tuning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shard.config import ShardConfig
from shard.layers import cublaslt, gemm_tuning

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _clean_table():
    gemm_tuning.clear()
    yield
    gemm_tuning.clear()


def _fake_algorithm(index: int) -> cublaslt.Algorithm:
    return cublaslt.Algorithm(index=index, algo_id=66, tile_id=index, splitk=1, stages_id=35,
                              cluster_id=2, workspace=0, waves=1.0, raw=bytes([index]) * 64)


def test_row_counts_halve_down_to_the_minimum():
    m = gemm_tuning.MIN_ROWS
    assert gemm_tuning.row_counts(4 * m) == [4 * m, 2 * m, m]
    assert gemm_tuning.row_counts(3 * m) == [3 * m, 3 * m // 2]
    assert gemm_tuning.row_counts(m - 1) == []


def test_lookup_takes_the_largest_tuned_row_count_at_or_below(monkeypatch):
    accepted = []
    monkeypatch.setattr(cublaslt, "accepts",
                        lambda m, n, k, dtype, algo: accepted.append(m) or algo.index != 9)
    m = gemm_tuning.MIN_ROWS
    big, small, rejected = _fake_algorithm(1), _fake_algorithm(2), _fake_algorithm(9)
    gemm_tuning._table[(64, 32, torch.bfloat16)] = [(4 * m, big), (m, small)]
    gemm_tuning._table[(8, 32, torch.bfloat16)] = [(m, rejected)]
    assert gemm_tuning.tuned()
    assert gemm_tuning.lookup(m - 1, 64, 32, torch.bfloat16) is None  # none tuned there
    assert gemm_tuning.lookup(m, 64, 32, torch.bfloat16) is small
    assert gemm_tuning.lookup(4 * m - 1, 64, 32, torch.bfloat16) is small
    assert gemm_tuning.lookup(4 * m, 64, 32, torch.bfloat16) is big
    assert gemm_tuning.lookup(4 * m, 64, 32, torch.float16) is None  # other dtype: not tuned
    assert gemm_tuning.lookup(m, 8, 32, torch.bfloat16) is None  # cuBLASLt rejects it here
    calls = len(accepted)
    gemm_tuning.lookup(m, 64, 32, torch.bfloat16)
    assert len(accepted) == calls  # the check is cached per row count
    gemm_tuning.clear()
    assert not gemm_tuning.tuned() and gemm_tuning.lookup(4 * m, 64, 32, torch.bfloat16) is None


def test_decode_anchors_are_the_powers_of_two_above_the_skinny_kernel_and_the_largest():
    from shard.cuda_graphs import default_buckets

    assert gemm_tuning.decode_anchors(default_buckets(512)) == [32, 64, 128, 256, 512]
    assert gemm_tuning.decode_anchors(default_buckets(200)) == [32, 64, 128, 200]
    assert gemm_tuning.decode_anchors([1, 2, 4, 8, 16]) == []
    assert gemm_tuning.decode_anchors([]) == []


def test_decode_sizes_take_only_the_algorithm_tuned_for_exactly_their_rows(monkeypatch):
    monkeypatch.setattr(cublaslt, "accepts", lambda *args: pytest.fail("no check needed"))
    at_256 = _fake_algorithm(3)
    gemm_tuning._exact[(256, 64, 32, torch.bfloat16)] = at_256
    assert gemm_tuning.tuned()
    assert gemm_tuning.lookup(256, 64, 32, torch.bfloat16) is at_256
    assert gemm_tuning.lookup(240, 64, 32, torch.bfloat16) is None
    assert gemm_tuning.lookup(272, 64, 32, torch.bfloat16) is None
    assert gemm_tuning.lookup(256, 64, 32, torch.float16) is None
    gemm_tuning.clear()
    assert not gemm_tuning.tuned() and gemm_tuning.lookup(256, 64, 32, torch.bfloat16) is None


def test_the_flag_is_validated():
    assert ShardConfig(model_path="m").gemm_tuning == "auto"
    assert ShardConfig(model_path="m", gemm_tuning="off").gemm_tuning == "off"
    with pytest.raises(ValueError, match="gemm_tuning"):
        ShardConfig(model_path="m", gemm_tuning="on")


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= 1e-2 * scale


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(4096, 768, 512), (256, 1536, 1024), (33, 640, 384)])
def test_every_candidate_gives_the_product(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype).cuda()
    want = F.linear(x, w)
    found = cublaslt.candidates(m, n, k, dtype)
    assert found and found[0].index == 0
    for algo in found:
        _assert_close(cublaslt.matmul(x, w, algo), want)
    variants = cublaslt.variants(m, n, k, dtype)
    assert len(variants) >= len(found)
    for algo in variants[:: max(1, len(variants) // 12)]:
        assert cublaslt.accepts(m, n, k, dtype, algo)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        assert cublaslt.matmul(x, w, algo, out=out) is out
        _assert_close(out, want)


@needs_cuda
def test_a_tuned_layer_gives_the_untuned_output(monkeypatch):
    from shard.layers.linear import _matmul

    monkeypatch.setattr(gemm_tuning, "MIN_ROWS", 512)
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # keep the fastest variant whatever it is
    gen = torch.Generator().manual_seed(3)
    weights = [(torch.randn(1024, 512, generator=gen) * 0.05).bfloat16().cuda() for _ in range(3)]
    results = gemm_tuning.tune(weights, max_rows=1024)
    assert [(r.rows, r.n, r.k) for r in results] == [(1024, 1024, 512), (512, 1024, 512)]
    assert all(r.algorithm is not None and r.screened > 0 for r in results)
    x = torch.randn(700, 512, generator=gen).bfloat16().cuda()
    bias = torch.randn(1024, generator=gen).bfloat16().cuda()
    assert gemm_tuning.lookup(700, 1024, 512, torch.bfloat16) is results[1].algorithm
    _assert_close(_matmul(x, weights[0], None, bias), F.linear(x, weights[0], bias))
    small = x[:100]
    assert gemm_tuning.run(small, weights[0], None) is None  # fewer rows than tuned: cuBLAS
    _assert_close(_matmul(small, weights[0], None, None), F.linear(small, weights[0]))


@needs_cuda
def test_decode_batch_sizes_are_tuned_and_captured_graphs_give_the_untuned_output(monkeypatch):
    from shard.layers.linear import _matmul

    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # keep the fastest variant whatever it is
    gen = torch.Generator().manual_seed(5)
    layers = [(torch.randn(768, 512, generator=gen) * 0.05).bfloat16().cuda() for _ in range(3)]
    head = (torch.randn(2000, 512, generator=gen) * 0.05).bfloat16().cuda()
    results = gemm_tuning.tune(layers, max_rows=1024, decode_rows=[1, 8, 16, 32, 48, 64],
                               decode_weights=[head])
    tuned = {(r.rows, r.n) for r in results if r.algorithm is not None}
    assert tuned == {(rows, n) for rows in (32, 48, 64) for n in (768, 2000)}
    assert not any(r.rows >= gemm_tuning.MIN_ROWS for r in results)  # budget below MIN_ROWS
    x = torch.randn(64, 512, generator=gen).bfloat16().cuda()
    for rows in (32, 48, 64):
        for w in (layers[0], head):
            assert gemm_tuning.lookup(rows, w.shape[0], 512, torch.bfloat16) is not None
            assert gemm_tuning.run(x[:rows], w, None) is None  # eager: F.linear
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _matmul(x[:rows], w, None, None)
            out.zero_()
            graph.replay()
            _assert_close(out, F.linear(x[:rows], w))
    assert gemm_tuning.lookup(40, 768, 512, torch.bfloat16) is None  # no graph of 40 rows
