"""Warm-up reaches every Triton kernel variant the eager steps of serving launch.

Triton compiles a kernel again for each new *variant* of its launch: other constexprs or
launch options, and, for each argument it specializes on, another class of value (an
integer equal to 1, a multiple of 16 or neither; a pointer aligned to 16 bytes or not).
A variant first met while serving compiles in the middle of a step (0.5-1 s on an H100,
every first token waiting). On the GPU the decode steps replay CUDA graphs captured at
warm-up; the steps that run eagerly are the prefills and the mixed steps (prompt chunks,
then the running batch's decode rows through the decode kernel). This test runs a tiny
model through our Triton backend and layer kernels (Triton's interpreter on the CPU),
records each launch's variant as Triton's JIT would key it, warms up (with a decode step
at each CUDA graph batch size, as capturing the graphs runs), then runs a seeded mix of
such steps, and checks that none of them launched a variant warm-up had not.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from shard.attention.triton_backend import TritonAttentionBackend
from shard.config import ShardConfig
from shard.cuda_graphs import parse_buckets
from shard.inputs import SeqChunk, build_inputs, concat_inputs
from shard.kernels.choices import KernelChoices
from shard.model_runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 4
PREFILL_BUDGET, MAX_TOTAL, MAX_BATCH = 64, 128, 16
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")


def _value_class(value: Any, specialize: bool) -> str:
    """What Triton's JIT keys an argument on: its type and, unless the parameter is in
    ``do_not_specialize``, whether an integer is 1 or a multiple of 16 and whether a
    pointer is 16-byte aligned."""
    if isinstance(value, torch.Tensor):
        aligned = value.data_ptr() % 16 == 0
        return f"*{value.dtype}" + (":16" if specialize and aligned else "")
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        if specialize and value == 1:
            return kind + "=1"
        return kind + (":16" if specialize and value % 16 == 0 else "")
    if isinstance(value, float):
        return "fp32"
    return repr(value)  # None and constexpr-like values


def variant(kernel: InterpretedFunction, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The variant of one launch: the kernel, its constexprs, each other argument's class
    (:func:`_value_class`) and the launch options."""
    params = inspect.signature(kernel.fn).parameters
    bound = {name: p.default for name, p in params.items()}
    bound.update(zip(params, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    frozen = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, p in params.items():
        if "constexpr" in str(p.annotation):
            key.append((name, repr(bound[name])))
        else:
            key.append((name, _value_class(bound[name], name not in frozen)))
    options = tuple((k, kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs)
    return (kernel.__name__, tuple(key), options)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Every kernel launch's variant, in order (launches still run)."""
    if DEVICE == "cuda":
        pytest.skip("records launches through Triton's interpreter (the CPU)")
    seen: list[tuple[Any, ...]] = []
    run = InterpretedFunction.run

    def record(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool,
               **kwargs: Any) -> Any:
        seen.append(variant(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    yield seen


def _runner(folder: Path, monkeypatch: pytest.MonkeyPatch, fp8: bool) -> ModelRunner:
    """A float16 tiny Llama on our Triton backend with every Triton layer kernel, as a
    runner on a GPU has them (the interpreter runs them here; those gated on CUDA
    tensors, the unquantized products and norms, do not run); with ``fp8``, fp8 weights
    and an fp8 KV cache."""
    monkeypatch.setattr(TritonAttentionBackend, "supports",
                        classmethod(lambda cls, spec: (True, "the interpreter")))
    kernels = KernelChoices.load(torch.device("cuda"), pdl="off")
    assert kernels.skinny_linear is not None and kernels.add_rms_norm is not None
    monkeypatch.setattr(KernelChoices, "load", classmethod(lambda cls, *a, **k: kernels))
    return ModelRunner(ShardConfig(model_path=str(folder), device=DEVICE, dtype="float16",
                                   block_size=BLOCK, attention_backend="triton",
                                   kv_cache_bytes=1 << 20, cuda_graphs="0",
                                   quantization="fp8" if fp8 else "none",
                                   kv_cache_dtype="fp8" if fp8 else "auto"))


def _chunk(rng: random.Random, length: int, start: int) -> SeqChunk:
    end = start + length
    return SeqChunk([rng.randrange(3, 128) for _ in range(length)], start,
                    list(range(-(-end // BLOCK))))


def _steps(rng: random.Random, count: int) -> Iterator[tuple[list[SeqChunk], list[SeqChunk]]]:
    """Seeded eager steps as serving makes them: prompt chunks (whole prompts, later
    chunks of long ones, prefix-cache hits at any offset), with or without decode rows
    of any context length after them."""
    for _ in range(count):
        budget = rng.randrange(1, PREFILL_BUDGET + 1)
        prompts: list[SeqChunk] = []
        while budget > 0 and len(prompts) < 6:
            length = rng.randrange(1, budget + 1)
            start = rng.choice([0, 0, rng.randrange(0, MAX_TOTAL - length + 1)])
            prompts.append(_chunk(rng, length, start))
            budget -= length
        decodes = [_chunk(rng, 1, rng.randrange(0, MAX_TOTAL))
                   for _ in range(rng.choice([0, 1, 2, 3, MAX_BATCH]))]
        yield prompts, decodes


@pytest.mark.parametrize("fp8", [False, True], ids=["float16", "fp8"])
def test_serving_steps_launch_no_variant_warm_up_did_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: list[tuple[Any, ...]],
    fp8: bool,
) -> None:
    from tests.unit.shard.helpers import make_hf_model

    make_hf_model("llama", tmp_path)
    runner = _runner(tmp_path, monkeypatch, fp8)
    runner.warmup(max_batch_prefill_tokens=PREFILL_BUDGET, max_total_tokens=MAX_TOTAL)
    rng = random.Random(0)
    device = torch.device(DEVICE)
    with torch.inference_mode():
        # on a GPU warm-up also captures the decode CUDA graphs, a decode step at each
        # batch size of --cuda-graphs auto: they compile what those launch
        for rows in parse_buckets("auto", MAX_BATCH):
            decodes = [_chunk(rng, 1, BLOCK) for _ in range(rows)]
            runner.forward(build_inputs(decodes, BLOCK, False, device))
    warm = set(launches)
    assert {v[0] for v in warm} >= {"_prefill_kernel", "_decode_kernel", "_combine_kernel",
                                    "_rope_write_kernel"}
    if fp8:  # the products of a few rows, and the rows quantized before each product
        assert {v[0] for v in warm} >= {"_skinny_gemm_kernel", "_rms_norm_fp8_kernel",
                                        "_silu_and_mul_fp8_kernel"}
    launches.clear()
    with torch.inference_mode():
        for prompts, decodes in _steps(rng, 8):
            inputs = build_inputs(prompts, BLOCK, True, device)
            if decodes:
                inputs = concat_inputs(inputs, build_inputs(decodes, BLOCK, False, device))
            runner.forward(inputs)
    late = sorted(set(launches) - warm, key=repr)
    assert launches and not late, "variants first launched after warm-up:\n" + "\n".join(
        f"{name} {options} {[a for a in args if a not in _warm_args(warm, name)]}"
        for name, args, options in late)


def _warm_args(warm: set[tuple[Any, ...]], name: str) -> set[tuple[str, str]]:
    """Every (argument, class) pair of ``name``'s warm-up variants: what a late variant
    differs in is the rest."""
    return {a for v in warm if v[0] == name for a in v[1]}
