"""Compile every Triton kernel of the shard for the H100/H200 (sm_90) on a machine
without a GPU, from the launches our wrappers make on small bf16 problems.

Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run the kernels) runs the
kernels' Python directly and accepts code the GPU compiler rejects; this runs the real
front end and back end (TTIR → TTGIR → LLVM → PTX → cubin) instead. Run it without
``TRITON_INTERPRET``: ``python -m tests.kernels.sm90_compile``. Prints one line per
distinct launch, ``compiled <kernel> <constexprs>`` or ``FAILED <kernel>: <error>``, and
exits 1 if any failed. The wrappers run twice, asked to launch without and with
programmatic dependent launch (``pdl``; :func:`shard.kernels.pdl.launch_options` as on
an sm_90 GPU): every launch must carry ``USE_PDL`` and Triton's ``launch_pdl`` as asked,
and with PDL each kernel's PTX must wait for the previous grid (``griddepcontrol.wait``)
before its first global memory access, the rule that makes the launch safe (see
shard/kernels/pdl.py).

The signature is built from the launch's arguments the way Triton's binder types them
(tensors as pointers of their dtype, ints as i32 or i64, floats as fp32), without its
value specialisations (divisibility by 16, ints equal to 1), which change only hints.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                 torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8",
                 torch.uint8: "*u8", torch.bool: "*i1", torch.float8_e4m3fn: "*fp8e4nv"}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")

Launch = tuple[JITFunction, dict[str, Any]]
# PTX that reads or writes global memory (loads, stores, async and bulk copies, atomics)
GLOBAL_MEMORY = re.compile(r"\b(ld|st|cp\.async|atom|red)(\.\w+)*\.global\b|\bcp\.async\.bulk")


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(kernel: JITFunction, bound: dict[str, Any]) -> str:
    """Compile one captured launch for sm_90 and return its PTX; raises what Triton's
    compiler raises."""
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = _arg_type(value)
    options = {k: bound[k] for k in OPTIONS if k in bound}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=TARGET, options=options)
    return str(compiled.asm["ptx"])


def memory_before_wait(ptx: str) -> str | None:
    """The first PTX line that touches global memory before ``griddepcontrol.wait`` (or
    the first such line at all when there is no wait); None when the wait comes first."""
    for line in ptx.splitlines():
        if "griddepcontrol.wait" in line:
            return None
        if GLOBAL_MEMORY.search(line):
            return line.strip()
    return "no griddepcontrol.wait"


def capture_launches(run_wrappers: Any) -> list[Launch]:
    """Call ``run_wrappers()`` with kernel launches recorded instead of run."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        bound = {p.name: p.default for p in self.params}
        bound.update(zip((p.name for p in self.params), args, strict=False))
        bound.update(kwargs)
        launches.append((self, bound))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        run_wrappers()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return launches


def _run_wrappers(pdl: bool) -> None:
    """Every wrapper of ours on small bf16 problems, each asked for ``pdl``."""
    from benchmarks.kernels.paged_cases import make_case, run_backend
    from shard.attention.triton_backend import TritonAttentionBackend
    from shard.kernels.attention import (
        DecodeConfig,
        decode_attention,
        prefill_attention,
        rope_write,
    )
    from shard.kernels.choices import KernelChoices
    from shard.kernels.gate_up_silu import gate_up_silu
    from shard.kernels.greedy import greedy
    from shard.kernels.rms_norm import add_rms_norm
    from shard.kernels.silu_mul import silu_and_mul
    from shard.kernels.skinny_gemm import skinny_fp8_linear, skinny_linear

    bf16 = torch.bfloat16
    for seq_lens, q_lens in (([40, 7], [1, 1]), ([40, 7], [30, 7])):  # decode, prefill
        case = make_case(seq_lens, q_lens, 32, 8, 128, dtype=bf16)
        run_backend(TritonAttentionBackend(KernelChoices(pdl=pdl)), case, case.fresh_cache())
    # prefill with the new K/V beside the cache, as views of a QKV output
    md = case.metadata
    new_kv = torch.randn(md.num_tokens, 2, 8, 128, dtype=bf16).unbind(1)
    prefill_attention(case.q, case.cache.key, case.cache.value, md.block_tables,
                      md.cu_seqlens_q, md.seq_lens, md.max_seqlen_q, case.scale,
                      new_kv=(new_kv[0], new_kv[1]), pdl=pdl)
    case = make_case([300], [1], 32, 8, 128, dtype=bf16)  # split KV and the combine
    decode_attention(case.q, case.cache.key, case.cache.value, case.metadata.block_tables,
                     case.metadata.seq_lens, 300, case.scale,
                     config=DecodeConfig(block_n=64, target_programs=10**4), pdl=pdl)
    qkv = torch.randn(2, 48 * 128, dtype=bf16)
    cos = sin = torch.randn(2, 128, dtype=bf16)
    weight = torch.ones(128, dtype=bf16)
    for norms, k_in_place in itertools.product(((), (weight, weight)), (False, True)):
        rope_write(qkv, 32, 8, cos, sin, case.cache.key, case.cache.value,
                   torch.tensor([0, 1]), *norms, k_in_place=k_in_place, pdl=pdl)
    silu_and_mul(torch.randn(3, 2 * 1000, dtype=bf16), pdl=pdl)
    rows = torch.randn(3, 4096, dtype=bf16)
    for residual in (None, rows):
        add_rms_norm(rows, residual, torch.ones(4096, dtype=bf16), 1e-5, pdl=pdl)
    greedy(torch.randn(2, 5000), pdl=pdl)
    # each default tile size (o/down, qkv, gate_up/LM head), with a bias, and capped tiles
    for m, n, bias in ((16, 4096, False), (1, 6144, False), (5, 6144, True), (1, 28672, False)):
        skinny_linear(torch.empty(m, 4096, dtype=bf16), torch.empty(n, 4096, dtype=bf16),
                      torch.empty(n, dtype=bf16) if bias else None, pdl=pdl)
    skinny_linear(torch.randn(2, 100, dtype=bf16), torch.randn(48, 100, dtype=bf16), pdl=pdl)
    fp8 = torch.float8_e4m3fn
    for m, n in ((1, 4096), (16, 6144), (1, 28672)):  # the fp8 products, each default tile
        skinny_fp8_linear(torch.empty(m, 4096, dtype=fp8), torch.ones(m),
                          torch.empty(n, 4096, dtype=fp8), torch.ones(n), pdl=pdl)
    for rows in (1, 32, 128):  # the three default configurations, the 8B-shaped model's gate/up
        gate_up_silu(torch.empty(rows, 4096, dtype=bf16),
                     torch.empty(2 * 14336, 4096, dtype=bf16), pdl=pdl)


@contextlib.contextmanager
def _as_on_sm90() -> Iterator[None]:
    """:func:`shard.kernels.pdl.launch_options` as on an sm_90 GPU: PDL where asked."""
    from shard.kernels import pdl

    original = pdl.available
    pdl.available = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        pdl.available = original  # type: ignore[assignment]


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    failed, seen = 0, set()
    launches = []
    for pdl_on in (False, True):
        with _as_on_sm90():
            for kernel, bound in capture_launches(functools.partial(_run_wrappers, pdl_on)):
                launches.append((kernel, bound))
                if (bound.get("USE_PDL") is not pdl_on
                        or bool(bound.get("launch_pdl", False)) is not pdl_on):
                    failed += 1
                    print(f"FAILED {kernel.__name__}: launched with USE_PDL="
                          f"{bound.get('USE_PDL')}, launch_pdl={bound.get('launch_pdl')} "
                          f"while the wrapper was asked for PDL {'on' if pdl_on else 'off'}")
    for kernel, bound in launches:
        constexprs = {p.name: bound[p.name] for p in kernel.params if p.is_constexpr}
        key = (kernel.__name__, repr(sorted(constexprs.items())),
               tuple(_arg_type(bound[p.name]) for p in kernel.params if not p.is_constexpr),
               tuple(bound.get(k) for k in OPTIONS))
        if key in seen:
            continue
        seen.add(key)
        try:
            ptx = compile_launch(kernel, bound)
            early = memory_before_wait(ptx) if bound.get("USE_PDL") else None
            if early is not None:
                raise AssertionError(f"global memory before griddepcontrol.wait: {early}")
        except Exception as error:  # every failure is reported, then the next launch
            failed += 1
            print(f"FAILED {kernel.__name__}: {type(error).__name__}: {error}")
        else:
            options = {k: bound[k] for k in OPTIONS if k in bound}
            print(f"compiled {kernel.__name__} {constexprs} {options}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
