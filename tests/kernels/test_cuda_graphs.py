"""Decode CUDA graphs: bucket parsing everywhere; on a CUDA GPU (skipped elsewhere) graph
replay against eager decode without programmatic dependent launch (the reference):
identical greedy tokens in float32, close logits in bfloat16, and padded rows that never
write a KV slot; with and without programmatic dependent launch, identical logits."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from shard.config import ShardConfig
from shard.cuda_graphs import default_buckets, parse_buckets
from shard.model_runner import ModelRunner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_default_buckets() -> None:
    assert default_buckets(1) == [1]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_parse_buckets() -> None:
    assert parse_buckets("0", 64) == [] and parse_buckets("", 64) == []
    assert parse_buckets("auto", 16) == [1, 2, 4, 8, 16]
    assert parse_buckets("8, 1,2,128", 64) == [1, 2, 8]
    with pytest.raises(ValueError, match="--cuda-graphs"):
        parse_buckets("1,two", 64)
    with pytest.raises(ValueError, match="positive"):
        parse_buckets("0,4", 64)


def _runner(folder: Path, dtype: str, graphs: str, max_batch_size: int = 8,
            pdl: str = "auto", without: tuple[str, ...] = ()) -> ModelRunner:
    """A warmed-up runner; ``without``: kernels of ours it never runs (its choices')."""
    runner = ModelRunner(ShardConfig(model_path=str(folder), device="cuda", dtype=dtype,
                                     block_size=4, attention_backend="triton",
                                     cuda_graphs=graphs, gpu_memory_fraction=0.2, pdl=pdl))
    for name in without:
        setattr(runner.kernels, name, None)
    runner.warmup(max_batch_prefill_tokens=256, max_total_tokens=512,
                  max_batch_size=max_batch_size)
    return runner


def _greedy(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Decode ``prompts``; after ``steps // 2`` steps the first request leaves
    (finished_request_ids; the rows shrink into a padded bucket)."""
    from tests.unit.shard.helpers import BlockPool, DecodeDriver, prefill, request

    pool = BlockPool(min(runner.num_blocks, 4096), seed=5)
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(prompts)]
    got = {rid: [tok] for rid, tok in prefill(runner, *reqs).items()}
    driver = DecodeDriver(runner, pool)
    for step in range(steps):
        out = driver.step(finished=(0,) if step == steps // 2 else ())
        assert list(out) == list(range(0 if step < steps // 2 else 1, len(prompts)))
        for rid, tok in out.items():
            got[rid].append(tok)
    return [got[i] for i in range(len(prompts))]


@needs_cuda
def test_graph_replay_gives_eager_tokens_fp32(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from tests.unit.shard.helpers import PROMPTS, make_hf_model

    make_hf_model("llama", tmp_path)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS[2:]]  # 6 rows → bucket 8, then 5
    eager_runner = _runner(tmp_path, "float32", "0", pdl="off")
    assert eager_runner.graphs is None
    eager = _greedy(eager_runner, prompts, 24)
    del eager_runner
    gc.collect()
    torch.cuda.empty_cache()
    runner = _runner(tmp_path, "float32", "auto")
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8]
    graphed = _greedy(runner, prompts, 24)
    assert graphed == eager


def _graph_logits(runner: ModelRunner, prompts: list[list[int]], steps: int) -> torch.Tensor:
    """Prefill ``prompts`` eagerly, then ``steps`` graph-replayed decode steps of them
    all; the logits of every step, stacked [steps, rows, vocab]."""
    from shard.decode_state import DecodeRows
    from tests.unit.shard.helpers import BlockPool, prefill, request

    pool = BlockPool(min(runner.num_blocks, 4096), seed=5)
    tables = [pool.for_tokens(len(p) + steps) for p in prompts]
    last = prefill(runner, *(request(i, p, t) for i, (p, t) in
                             enumerate(zip(prompts, tables, strict=True))))
    tokens = [last[i] for i in range(len(prompts))]
    steps_logits = []
    with torch.inference_mode():
        for step in range(steps):
            rows = DecodeRows.build(tokens, [len(p) + step for p in prompts], tables,
                                    torch.device("cuda"))
            logits = runner.graphs.run(rows).float()
            steps_logits.append(logits.clone())
            tokens = logits.argmax(-1).tolist()
    return torch.stack(steps_logits)


@needs_cuda
def test_pdl_graph_logits_equal_without_pdl_bf16(tmp_path: Path) -> None:
    """The same kernels launched with programmatic dependent launch compute the same
    bits: a kernel that read its input before the previous one finished would not."""
    pdl = pytest.importorskip("shard.kernels.pdl")  # imports Triton
    from tests.unit.shard.helpers import PROMPTS, make_hf_model

    if not pdl.available(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch here (needs sm_90 and Triton's gdc)")
    make_hf_model("llama", tmp_path)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS[2:]]  # 6 rows: bucket 8, skinny GEMMs
    plain_runner = _runner(tmp_path, "bfloat16", "auto", pdl="off")
    assert not plain_runner.kernels.pdl
    plain = _graph_logits(plain_runner, prompts, 12)
    del plain_runner
    gc.collect()
    torch.cuda.empty_cache()
    runner = _runner(tmp_path, "bfloat16", "auto")
    assert runner.kernels.pdl
    with_pdl = _graph_logits(runner, prompts, 12)
    print(f"\nGPU-CHECK pdl vs plain bf16 logits max diff "
          f"{(with_pdl - plain).abs().max().item():.3e}")
    assert torch.equal(with_pdl, plain)


@needs_cuda
def test_graph_logits_close_to_eager_bf16(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path, "bfloat16", "auto")
    assert runner.graphs is not None
    from shard.decode_state import DecodeRows

    torch.manual_seed(0)
    rows = DecodeRows.build([5, 9, 13], [7, 30, 2], [[3, 4], [5, 6, 7, 8, 9, 10, 11, 12], [1]],
                            torch.device("cuda"))
    with torch.inference_mode():
        graphed = runner.graphs.run(rows).clone()
        inputs = rows.model_inputs(runner.block_size, 31)
        eager = runner.model.compute_logits(runner.forward(inputs))
    err = ((graphed - eager).norm() / eager.norm()).item()
    print(f"\nGPU-CHECK graph vs eager bf16 logits rel_err={err:.2e}")
    assert err < 2e-2


@needs_cuda
def test_graph_with_tuned_products_close_to_eager_bf16(tmp_path: Path, monkeypatch) -> None:
    """A 32-row bucket captures the cuBLASLt algorithms tuned for 32 rows at warm-up; the
    eager forward of the same 20 rows keeps ``F.linear`` (no tuning for 20 rows). The
    fused gate/up + SwiGLU kernel, which takes gate/up at 32 rows, is off, so that every
    product of the graph is a cuBLASLt one."""
    pytest.importorskip("triton")
    from shard.decode_state import DecodeRows
    from shard.kernels import cublaslt, gemm_tuning
    from shard.layers.product_weights import linear_weights, lm_head_weights
    from tests.unit.shard.helpers import make_hf_model

    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # keep the fastest variant whatever it is
    captured: list[int] = []  # rows of each cuBLASLt product recorded into a graph
    matmul = cublaslt.matmul

    def counting(x, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            captured.append(x.shape[0])
        return matmul(x, *args, **kwargs)

    monkeypatch.setattr(cublaslt, "matmul", counting)
    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path, "bfloat16", "auto", max_batch_size=32, without=("gate_up_silu",))
    assert runner.graphs is not None and 32 in runner.graphs.buckets
    products = linear_weights(runner.model) + lm_head_weights(runner.model)
    table = runner.kernels.gemms
    for w in products:
        assert table.lookup(32, *w.shape, torch.bfloat16) is not None
        assert table.lookup(20, *w.shape, torch.bfloat16) is None
    # the 32-row graph runs every product through its tuned algorithm, no other does
    assert captured and set(captured) == {32} and len(captured) % len(products) == 0
    torch.manual_seed(0)
    contexts = [3 + (7 * i) % 29 for i in range(20)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(20)]  # 32 tokens each
    rows = DecodeRows.build(list(range(1, 21)), contexts, tables, torch.device("cuda"))
    with torch.inference_mode():
        graphed = runner.graphs.run(rows).clone()
        inputs = rows.model_inputs(runner.block_size, max(contexts) + 1)
        eager = runner.model.compute_logits(runner.forward(inputs))
    err = ((graphed - eager).norm() / eager.norm()).item()
    print(f"\nGPU-CHECK graph (tuned products) vs eager bf16 logits rel_err={err:.2e}")
    assert err < 2e-2


@needs_cuda
def test_rows_the_fused_gate_up_kernel_takes_are_not_tuned(tmp_path: Path, monkeypatch) -> None:
    """At 32 rows gate/up runs through the fused gate/up + SwiGLU kernel: the warm-up
    searches no product for it there (it does for the other projections). The tied
    model's LM head (128 x 64) does not share gate/up's shape (256 x 64), as the untied
    one's would (a shared shape is tuned for the LM head)."""
    pytest.importorskip("triton")
    from shard.kernels import gemm_tuning
    from shard.layers.product_weights import lm_head_weights
    from shard.models.llama import LlamaMLP
    from tests.unit.shard.helpers import make_hf_model

    monkeypatch.setattr(gemm_tuning, "MARGIN", -1.0)  # keep the fastest variant whatever it is
    make_hf_model("llama_tied", tmp_path)
    runner = None
    try:
        runner = _runner(tmp_path, "bfloat16", "auto", max_batch_size=32)
        mlp = next(m for m in runner.model.modules() if isinstance(m, LlamaMLP))
        gate_up = mlp.gate_up_proj.weight.shape
        qkv = runner.model.model.layers[0].self_attn.qkv_proj.weight.shape
        assert gate_up not in {w.shape for w in lm_head_weights(runner.model)}
        assert runner.kernels.gemms.lookup(32, *gate_up, torch.bfloat16) is None
        assert runner.kernels.gemms.lookup(32, *qkv, torch.bfloat16) is not None
    finally:
        del runner
        gc.collect()


@needs_cuda
def test_padded_rows_write_no_kv_slot(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from shard.decode_state import DecodeRows
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path, "float32", "auto")
    assert runner.graphs is not None
    # 3 rows in bucket 4; the 4th (padded) row must not write anything
    rows = DecodeRows.build([1, 2, 3], [4, 5, 6], [[10, 11], [12, 13], [14, 15]],
                            torch.device("cuda"))
    with torch.inference_mode():
        runner.graphs.run(DecodeRows.build([1] * 4, [9] * 4, [[20, 21, 22]] * 4,
                                           torch.device("cuda")))  # 4 rows fill bucket 4
        for layer in runner.kv_cache:
            layer.key.fill_(7.0)
            layer.value.fill_(7.0)
        runner.graphs.run(rows)
    torch.cuda.synchronize()
    # slot of each row's new token (position seq_len): table[pos // 4] * 4 + pos % 4
    written = {11 * 4 + 0, 13 * 4 + 1, 15 * 4 + 2}
    for layer in runner.kv_cache:
        for cache in (layer.key, layer.value):
            flat = cache.reshape(cache.shape[0] * cache.shape[1], -1)
            changed = (flat != 7.0).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) == written


@needs_cuda
def test_block_table_wider_than_captured_replays(tmp_path: Path) -> None:
    """Tables widen by doubling, so a row may carry more columns than the graph was
    captured with (max_total_tokens / block_size = 128 here); only those within its
    context are read, and the replay matches eager decode."""
    pytest.importorskip("triton")
    from shard.decode_state import DecodeRows
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path, "float32", "auto")
    assert runner.graphs is not None and runner.graphs.block_tables.shape[1] == 128
    wide = [list(range(10, 10 + 300)), list(range(400, 400 + 300))]
    rows = DecodeRows.build([5, 9], [7, 30], wide, torch.device("cuda"))
    assert rows.block_tables.shape[1] == 300
    with torch.inference_mode():
        graphed = runner.graphs.run(rows).clone()
        inputs = rows.model_inputs(runner.block_size, 31)
        eager = runner.model.compute_logits(runner.forward(inputs))
    assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
    assert torch.allclose(graphed, eager, atol=1e-4, rtol=1e-4)
