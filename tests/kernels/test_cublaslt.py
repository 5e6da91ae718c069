"""cuBLASLt products with a chosen algorithm (:mod:`shard.kernels.cublaslt`) against
``F.linear``, the warm-up tuning that picks them into a runner's table
(:mod:`shard.kernels.gemm_tuning`) and the results kept on disk
(:mod:`shard.kernels.tuning_cache`).

CPU: the tuning's bookkeeping (row counts, lookup, the flag); GPU: every candidate and
variant cuBLASLt offers gives ``F.linear``'s product, a tuned linear layer gives the same
output as without tuning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shard.config import ShardConfig
from shard.kernels import cublaslt, gemm_tuning, tuning_cache
from shard.kernels.choices import KernelChoices

BF16 = torch.bfloat16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def table() -> gemm_tuning.GemmTable:
    """A runner's table of tuned algorithms, empty."""
    return gemm_tuning.GemmTable()


def _fake_algorithm(index: int) -> cublaslt.Algorithm:
    return cublaslt.Algorithm(index=index, algo_id=66, tile_id=index, splitk=1, stages_id=35,
                              cluster_id=2, workspace=0, waves=1.0, raw=bytes([index]) * 64)


def test_row_counts_halve_down_to_the_minimum():
    m = gemm_tuning.MIN_ROWS
    assert gemm_tuning.row_counts(4 * m) == [4 * m, 2 * m, m]
    assert gemm_tuning.row_counts(3 * m) == [3 * m, 3 * m // 2]
    assert gemm_tuning.row_counts(m - 1) == []


def test_lookup_takes_the_largest_tuned_row_count_at_or_below(monkeypatch, table):
    accepted = []
    monkeypatch.setattr(cublaslt, "accepts", lambda m, n, k, dtype, algo, device:
                        accepted.append((m, device)) or algo.index != 9)
    m = gemm_tuning.MIN_ROWS
    big, small, rejected = _fake_algorithm(1), _fake_algorithm(2), _fake_algorithm(9)
    table._table[(64, 32, torch.bfloat16)] = [(4 * m, big), (m, small)]
    table._table[(8, 32, torch.bfloat16)] = [(m, rejected)]
    assert table.tuned()
    assert table.lookup(m - 1, 64, 32, torch.bfloat16) is None  # none tuned there
    assert table.lookup(m, 64, 32, torch.bfloat16) is small
    assert table.lookup(4 * m - 1, 64, 32, torch.bfloat16) is small
    assert table.lookup(4 * m, 64, 32, torch.bfloat16) is big
    assert table.lookup(4 * m, 64, 32, torch.float16) is None  # other dtype: not tuned
    assert table.lookup(m, 8, 32, torch.bfloat16) is None  # cuBLASLt rejects it here
    calls = len(accepted)
    table.lookup(m, 64, 32, torch.bfloat16)
    assert len(accepted) == calls  # the check is cached per row count
    table.lookup(m, 64, 32, torch.bfloat16, device=1)
    assert accepted[-1] == (m, 1) and len(accepted) == calls + 1  # and per device
    table.clear()
    assert not table.tuned() and table.lookup(4 * m, 64, 32, torch.bfloat16) is None


def test_decode_anchors_are_the_powers_of_two_above_the_skinny_kernel_and_the_largest():
    from shard.cuda_graphs import default_buckets

    assert gemm_tuning.decode_anchors(default_buckets(512)) == [32, 64, 128, 256, 512]
    assert gemm_tuning.decode_anchors(default_buckets(200)) == [32, 64, 128, 200]
    assert gemm_tuning.decode_anchors([1, 2, 4, 8, 16]) == []
    assert gemm_tuning.decode_anchors([]) == []


def test_the_decode_plan_leaves_out_rows_another_kernel_serves():
    from shard.cuda_graphs import default_buckets

    buckets = default_buckets(512)
    anchors, others = gemm_tuning.decode_plan(buckets)
    assert anchors == [32, 64, 128, 256, 512]
    assert others == [r for r in buckets if r > 16 and r not in anchors] and 48 in others
    # the fused gate/up kernel's 1-128 rows: its shape searched from 256, chosen from 144
    anchors, others = gemm_tuning.decode_plan(buckets, range(1, 129))
    assert anchors == [256, 512] and others[0] == 144 and 128 not in others
    assert gemm_tuning.decode_plan([1, 2, 4, 8, 16], range(1, 129)) == ([], [])


def test_rows_are_left_out_only_where_every_weight_of_the_shape_is_served_elsewhere():
    gate_up, other = torch.empty(256, 64), torch.empty(256, 64)
    fused = {gate_up.data_ptr(): range(1, 129)}
    assert gemm_tuning.served_elsewhere([gate_up], fused) == set(range(1, 129))
    assert gemm_tuning.served_elsewhere([gate_up, other], fused) == set()  # an LM head
    assert gemm_tuning.served_elsewhere([gate_up], None) == set()


def test_the_fused_gate_up_rows_are_known_per_weight(tmp_path, monkeypatch):
    from torch import nn

    from shard.models.config import ModelConfig
    from shard.models.llama import LlamaMLP, fused_decode_rows
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    mlp = LlamaMLP(ModelConfig.from_pretrained(str(tmp_path)))
    model = nn.ModuleList([nn.Linear(4, 4), mlp])
    assert fused_decode_rows(model) == {}  # CPU weights: the kernel never runs
    pytest.importorskip("triton")
    monkeypatch.setattr(LlamaMLP, "_fused_kernel", lambda self: object())  # as on CUDA
    assert fused_decode_rows(model) == {}  # float32: the kernel declines, products run
    model.to(torch.bfloat16)
    from shard.kernels.gate_up_silu import MAX_ROWS, MIN_ROWS

    assert fused_decode_rows(model) == {
        mlp.gate_up_proj.weight.data_ptr(): range(MIN_ROWS, MAX_ROWS + 1)}


def test_decode_sizes_take_only_the_algorithm_tuned_for_exactly_their_rows(monkeypatch, table):
    monkeypatch.setattr(cublaslt, "accepts", lambda *args: pytest.fail("no check needed"))
    at_256 = _fake_algorithm(3)
    table._exact[(256, 64, 32, torch.bfloat16)] = at_256
    assert table.tuned()
    assert table.lookup(256, 64, 32, torch.bfloat16) is at_256
    assert table.lookup(240, 64, 32, torch.bfloat16) is None
    assert table.lookup(272, 64, 32, torch.bfloat16) is None
    assert table.lookup(256, 64, 32, torch.float16) is None
    table.clear()
    assert not table.tuned() and table.lookup(256, 64, 32, torch.bfloat16) is None


def _fake_weights(n: int, k: int) -> list[torch.Tensor]:
    return [torch.empty(n, k, dtype=torch.bfloat16)]  # only the shape and dtype are read


def test_the_cache_file_is_named_by_device_and_identity(tmp_path):
    identity = {"format": 1, "device": "NVIDIA H200", "cublaslt": 130000}
    path = tuning_cache.cache_file(tmp_path, identity)
    assert path.parent == tmp_path and path.name.startswith("NVIDIA-H200-")
    assert tuning_cache.cache_file(tmp_path, {**identity, "cublaslt": 130001}) != path


def test_cached_results_are_reused_and_nothing_is_searched(tmp_path, monkeypatch, table):
    monkeypatch.setattr(gemm_tuning, "_runs", lambda *args: True)
    identity = {"format": 1, "device": "gpu"}
    path = tuning_cache.cache_file(tmp_path, identity)
    kept, searches = _fake_algorithm(4), []

    def search(rows, algorithm, k=32):
        def run():
            searches.append(algorithm)
            return tuning_cache.TunedProduct(rows, 64, k, 10.0, 9.0, algorithm, 100)
        return run

    cache = tuning_cache.TuningCache(path, identity)
    first = gemm_tuning._tuned(cache, 256, _fake_weights(64, 32), search(256, kept), "full",
                               table)
    gemm_tuning._tuned(cache, 512, _fake_weights(64, 32), search(512, None), "full", table)
    assert first.algorithm is kept and len(searches) == 2
    cache.save()
    table.clear()

    again = tuning_cache.TuningCache(path, identity)
    hit = gemm_tuning._tuned(again, 256, _fake_weights(64, 32), search(256, None), "full",
                             table)
    assert hit.algorithm == kept and hit.screened == 0 and (hit.default_us, hit.best_us) == (10, 9)
    assert table.lookup(256, 64, 32, torch.bfloat16) == kept  # recorded for use
    none_kept = gemm_tuning._tuned(again, 512, _fake_weights(64, 32), search(512, kept),
                                   "full", table)
    assert none_kept.algorithm is None and none_kept.screened == 0
    assert len(searches) == 2
    gemm_tuning._tuned(again, 256, _fake_weights(64, 16), search(256, None, k=16),
                       "full", table)  # a new shape
    assert len(searches) == 3


def test_a_cached_algorithm_cuBLASLt_rejects_is_searched_again(tmp_path, monkeypatch, table):
    identity = {"format": 1, "device": "gpu"}
    cache = tuning_cache.TuningCache(tuning_cache.cache_file(tmp_path, identity), identity)
    cache.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, _fake_algorithm(4), 100),
              torch.bfloat16, "full")
    monkeypatch.setattr(gemm_tuning, "_runs", lambda *args: False)
    fresh = tuning_cache.TunedProduct(256, 64, 32, 10.0, 10.0, None, 100)
    assert gemm_tuning._tuned(cache, 256, _fake_weights(64, 32), lambda: fresh, "full",
                              table) is fresh
    assert not table.tuned()


def test_another_identity_or_a_broken_file_counts_as_empty(tmp_path):
    identity = {"format": 1, "device": "gpu"}
    path = tuning_cache.cache_file(tmp_path, identity)
    cache = tuning_cache.TuningCache(path, identity)
    cache.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, None, 100), BF16, "full")
    cache.save()
    assert tuning_cache.TuningCache(path, identity).get(256, 64, 32, torch.bfloat16) is not None
    assert tuning_cache.TuningCache(path, {**identity, "device": "other"}).records == {}
    path.write_text("{not json")
    warnings = []

    class Log:
        def warning(self, *args):
            warnings.append(args)

    assert tuning_cache.TuningCache(path, identity, Log()).records == {}
    assert warnings and "unreadable" in warnings[0][2]


def test_save_merges_what_another_process_wrote_meanwhile(tmp_path):
    identity = {"format": 1, "device": "gpu"}
    path = tuning_cache.cache_file(tmp_path / "new" / "folder", identity)
    ours, theirs = (tuning_cache.TuningCache(path, identity) for _ in range(2))
    ours.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, None, 100), BF16, "full")
    theirs.put(tuning_cache.TunedProduct(256, 32, 64, 8.0, 9.0, None, 100), BF16, "full")
    theirs.save()
    ours.save()
    merged = tuning_cache.TuningCache(path, identity)
    assert merged.get(256, 64, 32, torch.bfloat16) is not None
    assert merged.get(256, 32, 64, torch.bfloat16) is not None
    assert not list(path.parent.glob(".tuning-*"))  # no temporary left


def test_an_unwritable_cache_is_left_alone(tmp_path):
    identity = {"format": 1, "device": "gpu"}
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = tuning_cache.TuningCache(tuning_cache.cache_file(blocker, identity), identity)
    cache.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, None, 100), BF16, "full")
    cache.save()  # its folder cannot be made: nothing raised
    assert len(cache.added) == 1  # kept for a later save


def test_malformed_records_count_as_missing(tmp_path):
    identity = {"format": 1, "device": "gpu"}
    cache = tuning_cache.TuningCache(tuning_cache.cache_file(tmp_path, identity), identity)
    cache.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, _fake_algorithm(4), 100),
              torch.bfloat16, "full")
    good = cache.get(256, 64, 32, torch.bfloat16)
    assert good is not None and good.algorithm == _fake_algorithm(4)
    record = cache.records["256,64,32,bfloat16"]
    for raw in ("abcd", "zz" * 64, 17):  # too short, not hex, not a string
        record["algorithm"]["raw"] = raw
        assert cache.get(256, 64, 32, torch.bfloat16) is None
    cache.records["256,64,32,bfloat16"] = ["not", "a", "record"]
    assert cache.get(256, 64, 32, torch.bfloat16) is None


def test_a_search_that_timed_nothing_is_not_cached(tmp_path, table):
    identity = {"format": 1, "device": "gpu"}
    cache = tuning_cache.TuningCache(tuning_cache.cache_file(tmp_path, identity), identity)
    nothing = tuning_cache.TunedProduct(256, 64, 32, 10.0, float("inf"), None, 0)
    assert gemm_tuning._tuned(cache, 256, _fake_weights(64, 32), lambda: nothing, "choice",
                              table) is nothing
    assert cache.get(256, 64, 32, torch.bfloat16) is None and not cache.added
    failed = tuning_cache.TunedProduct(256, 64, 32, 10.0, float("inf"), None, 12)
    gemm_tuning._tuned(cache, 256, _fake_weights(64, 32), lambda: failed, "full", table)
    assert not cache.added  # variants screened, but every finalist failed
    timed = tuning_cache.TunedProduct(256, 64, 32, 10.0, 11.0, None, 2)
    gemm_tuning._tuned(cache, 256, _fake_weights(64, 32), lambda: timed, "choice", table)
    assert cache.records["256,64,32,bfloat16"]["search"] == "choice"


def test_save_keeps_newer_results_of_other_processes_for_keys_it_did_not_add(tmp_path):
    identity = {"format": 1, "device": "gpu"}
    path = tuning_cache.cache_file(tmp_path, identity)
    first = tuning_cache.TuningCache(path, identity)
    first.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, None, 100), torch.bfloat16,
              "full")
    first.save()
    ours, theirs = (tuning_cache.TuningCache(path, identity) for _ in range(2))
    theirs.put(tuning_cache.TunedProduct(256, 64, 32, 20.0, 19.0, None, 100), torch.bfloat16,
               "full")
    theirs.save()
    ours.put(tuning_cache.TunedProduct(512, 64, 32, 30.0, 29.0, None, 100), torch.bfloat16,
             "full")
    ours.save()
    merged = tuning_cache.TuningCache(path, identity)
    assert merged.get(256, 64, 32, torch.bfloat16).default_us == 20.0  # theirs, not ours' old
    assert merged.get(512, 64, 32, torch.bfloat16).default_us == 30.0
    assert path.stat().st_mode & 0o777 == 0o644  # readable by other users of a shared cache


def test_a_cached_algorithm_is_checked_then_run_once_on_the_weights_device(monkeypatch):
    calls = []

    def accepts(m, n, k, dtype, algo, device):
        calls.append(("accepts", m, n, k, device))
        return algo.index != 9

    def matmul(x, w, algo, out):
        calls.append(("matmul", tuple(x.shape), tuple(out.shape)))
        if algo.index == 7:
            raise cublaslt.CublasLtError("rejected at launch")
        return out

    monkeypatch.setattr(cublaslt, "accepts", accepts)
    monkeypatch.setattr(cublaslt, "matmul", matmul)
    weights = _fake_weights(64, 32)
    assert gemm_tuning._runs(256, weights, _fake_algorithm(4))
    # checked on the weights' device (None for these CPU stand-ins), not a fixed one
    assert calls == [("accepts", 256, 64, 32, None), ("matmul", (256, 32), (256, 64))]
    calls.clear()
    assert not gemm_tuning._runs(256, weights, _fake_algorithm(9))  # refused by the check
    assert calls == [("accepts", 256, 64, 32, None)]
    assert not gemm_tuning._runs(256, weights, _fake_algorithm(7))  # refused at launch


def test_a_failed_save_leaves_no_temporary_and_keeps_its_records(tmp_path, monkeypatch):
    identity = {"format": 1, "device": "gpu"}
    path = tuning_cache.cache_file(tmp_path, identity)
    cache = tuning_cache.TuningCache(path, identity)
    cache.put(tuning_cache.TunedProduct(256, 64, 32, 10.0, 9.0, None, 100), BF16, "full")

    def refuse(*args):
        raise OSError("disk full")

    monkeypatch.setattr(tuning_cache.os, "replace", refuse)
    cache.save()
    assert not path.exists() and not list(tmp_path.glob(".tuning-*"))
    assert cache.added == {"256,64,32,bfloat16"}  # saved by a later save
    monkeypatch.undo()
    cache.save()
    assert tuning_cache.TuningCache(path, identity).get(256, 64, 32, BF16).cached


def test_only_products_without_a_bias_are_tuned():
    from torch import nn

    from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
    from shard.layers.product_weights import linear_weights

    model = nn.Sequential(ColumnParallelLinear(16, 24, bias=True),   # bias in the product
                          ColumnParallelLinear(16, 24, bias=False),
                          RowParallelLinear(24, 16, bias=True))       # bias after the reduce
    assert [w.shape for w in linear_weights(model)] == [(24, 16), (16, 24)]
    assert linear_weights(model)[0].data_ptr() == model[1].weight.data_ptr()


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
def test_a_tuned_layer_gives_the_untuned_output(monkeypatch, table):
    from shard.layers.linear import linear_product

    kernels = KernelChoices(gemms=table)

    monkeypatch.setattr(gemm_tuning, "MIN_ROWS", 512)
    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # keep the fastest variant whatever it is
    gen = torch.Generator().manual_seed(3)
    weights = [(torch.randn(1024, 512, generator=gen) * 0.05).bfloat16().cuda() for _ in range(3)]
    results = gemm_tuning.tune(table, weights, max_rows=1024)
    assert [(r.rows, r.n, r.k) for r in results] == [(1024, 1024, 512), (512, 1024, 512)]
    assert all(r.algorithm is not None and r.screened > 0 for r in results)
    x = torch.randn(700, 512, generator=gen).bfloat16().cuda()
    bias = torch.randn(1024, generator=gen).bfloat16().cuda()
    assert table.lookup(700, 1024, 512, torch.bfloat16) is results[1].algorithm
    assert table.run(x, weights[0], None) is not None
    _assert_close(linear_product(x, weights[0], None, None, kernels), F.linear(x, weights[0]))
    assert table.run(x, weights[0], bias) is None  # a bias: F.linear's epilogue
    _assert_close(linear_product(x, weights[0], None, bias, kernels), F.linear(x, weights[0], bias))
    small = x[:100]
    assert table.run(small, weights[0], None) is None  # fewer rows than tuned: cuBLAS
    _assert_close(linear_product(small, weights[0], None, None, kernels),
                  F.linear(small, weights[0]))


@needs_cuda
def test_decode_batch_sizes_are_tuned_and_captured_graphs_give_the_untuned_output(
        monkeypatch, table):
    from shard.layers.linear import linear_product

    kernels = KernelChoices(gemms=table)

    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # keep the fastest variant whatever it is
    gen = torch.Generator().manual_seed(5)
    layers = [(torch.randn(768, 512, generator=gen) * 0.05).bfloat16().cuda() for _ in range(3)]
    head = (torch.randn(2000, 512, generator=gen) * 0.05).bfloat16().cuda()
    results = gemm_tuning.tune(table, layers, max_rows=1024, decode_rows=[1, 8, 16, 32, 48, 64],
                               decode_weights=[head])
    tuned = {(r.rows, r.n) for r in results if r.algorithm is not None}
    assert tuned == {(rows, n) for rows in (32, 48, 64) for n in (768, 2000)}
    assert not any(r.rows >= gemm_tuning.MIN_ROWS for r in results)  # budget below MIN_ROWS
    x = torch.randn(64, 512, generator=gen).bfloat16().cuda()
    for rows in (32, 48, 64):
        for w in (layers[0], head):
            assert table.lookup(rows, w.shape[0], 512, torch.bfloat16) is not None
            assert table.run(x[:rows], w, None) is None  # eager: F.linear
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = linear_product(x[:rows], w, None, None, kernels)
            out.zero_()
            graph.replay()
            _assert_close(out, F.linear(x[:rows], w))
    assert table.lookup(40, 768, 512, torch.bfloat16) is None  # no graph of 40 rows


@needs_cuda
def test_a_second_warm_up_takes_every_result_from_the_cache(tmp_path, table):
    gen = torch.Generator().manual_seed(7)
    layers = [(torch.randn(768, 512, generator=gen) * 0.05).bfloat16().cuda() for _ in range(3)]
    identity = tuning_cache.cache_identity(layers[0].device)
    path = tuning_cache.cache_file(tmp_path, identity)
    first = gemm_tuning.tune(table, layers, max_rows=0, decode_rows=[32, 48, 64],
                             cache=tuning_cache.TuningCache(path, identity))
    assert path.exists() and all(r.screened for r in first)
    chosen = {r.rows: table.lookup(r.rows, 768, 512, torch.bfloat16) for r in first}
    table.clear()
    second = gemm_tuning.tune(table, layers, max_rows=0, decode_rows=[32, 48, 64],
                              cache=tuning_cache.TuningCache(path, identity))
    assert [(r.rows, r.algorithm) for r in second] == [(r.rows, r.algorithm) for r in first]
    assert all(r.cached and not r.screened for r in second)
    assert {r.rows: table.lookup(r.rows, 768, 512, torch.bfloat16) for r in second} == chosen
