"""On a CUDA GPU (skipped elsewhere): every backend that can be brought up against an
fp32 ``torch`` reference at real sizes in bf16 (relative error < 1e-2), and greedy
tokens of a tiny model with ``triton`` equal to those with ``torch``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.kernels.paged_cases import make_case, reference, rel_error, run_backend
from shard.attention import AttentionSpec, get_backend_class
from shard.config import ShardConfig
from shard.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_BACKENDS = ["triton", "flashinfer", "flash_attn"]
# (num_heads, num_kv_heads): group sizes 1, 3, 4, 8
HEADS = [(8, 8), (24, 8), (32, 8), (64, 8)]
DECODE = ([1, 515, 2048, 4096, 17, 1000, 3333, 256], [1] * 8)
PREFILL = ([1024, 700, 2048, 33], [1024, 200, 512, 1])  # plain, prefix + new, ...
FRESH = ([1024, 700, 33, 1], [1024, 700, 33, 1])  # no cached prefix anywhere


def _bring_up(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Skip unless backend ``name`` runs this shape; returns its block size."""
    cls = get_backend_class(name)
    block_size = cls.kv_block_size(16)
    spec = AttentionSpec(torch.device("cuda"), torch.bfloat16, num_heads, num_kv_heads,
                         head_dim, block_size)
    ok, reason = cls.supports(spec)
    if not ok:
        pytest.skip(f"{name}: {reason}")
    return block_size


@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("phase", ["decode", "prefill", "fresh_prefill"])
def test_backend_bf16_vs_fp32_reference(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, phase: str
) -> None:
    block_size = _bring_up(name, num_heads, num_kv_heads, head_dim)
    seq_lens, q_lens = {"decode": DECODE, "prefill": PREFILL, "fresh_prefill": FRESH}[phase]
    case = make_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size,
                     torch.bfloat16, "cuda", seed=num_heads + head_dim)
    ref, _ = reference(case)
    backend = get_backend_class(name)()
    out = run_backend(backend, case, case.fresh_cache())
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    err = rel_error(out, ref)
    print(f"\nGPU-CHECK {name} {phase} H={num_heads} HKV={num_kv_heads} D={head_dim} "
          f"rel_err={err:.2e}")
    assert err < 1e-2


def _greedy(folder: Path, backend: str, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    from tests.unit.shard.helpers import BlockPool, DecodeDriver, prefill, request

    runner = ModelRunner(ShardConfig(model_path=str(folder), device="cuda", dtype=dtype,
                                     block_size=4, attention_backend=backend,
                                     gpu_memory_fraction=0.05))
    runner.warmup(max_batch_prefill_tokens=256, max_total_tokens=512)
    pool = BlockPool(min(runner.num_blocks, 4096), seed=5)
    reqs = [request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(prompts)]
    got = {rid: [tok] for rid, tok in prefill(runner, *reqs).items()}
    driver = DecodeDriver(runner, pool)
    for _ in range(29):
        for rid, tok in driver.step().items():
            got[rid].append(tok)
    return [got[i] for i in range(len(prompts))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_triton_equal_torch(tmp_path: Path, dtype: str) -> None:
    pytest.importorskip("triton")
    from tests.unit.shard.helpers import PROMPTS, make_hf_model

    make_hf_model("llama", tmp_path)
    torch_tokens = _greedy(tmp_path, "torch", dtype, PROMPTS)
    triton_tokens = _greedy(tmp_path, "triton", dtype, PROMPTS)
    same = sum(a == b for a, b in zip(torch_tokens, triton_tokens, strict=True))
    print(f"\nGPU-CHECK greedy {dtype}: {same}/{len(PROMPTS)} sequences equal over 30 tokens")
    if dtype == "float32":
        assert triton_tokens == torch_tokens
