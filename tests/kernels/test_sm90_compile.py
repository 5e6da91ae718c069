"""Every Triton kernel of the shard compiles for the H100/H200 (sm_90), checked on the CPU
by Triton's real compiler (the interpreter, which runs the CPU kernel tests, accepts code
the GPU compiler rejects). See tests/kernels/sm90_compile.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ["_cache_write_kernel", "_decode_kernel", "_prefill_kernel", "_combine_kernel",
           "_rope_write_kernel", "_silu_and_mul_kernel", "_rms_norm_kernel", "_greedy_kernel",
           "_skinny_gemm_kernel", "_gate_up_silu_kernel"]


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    compiled = {line.split()[1] for line in result.stdout.splitlines()
                if line.startswith("compiled ")}
    assert compiled == set(KERNELS), result.stdout
    # every launch also with programmatic dependent launch (USE_PDL: True)
    pdl = [line for line in result.stdout.splitlines() if "'USE_PDL': True" in line]
    assert {line.split()[1] for line in pdl} == set(KERNELS), result.stdout
    assert 2 * len(pdl) == result.stdout.count("compiled "), result.stdout
    plain = "\n".join(line for line in result.stdout.splitlines()
                      if "'USE_PDL': False" in line)
    # rope_write with and without q/k norms, each with and without the keys in place;
    # prefill with and without the new K/V; both decode paths
    assert plain.count("compiled _rope_write_kernel") == 4
    assert plain.count("compiled _prefill_kernel") == 2
    assert plain.count("compiled _decode_kernel") == 2
    assert plain.count("compiled _rms_norm_kernel") == 2  # with and without residual
    # skinny GEMM: the three default tile sizes, one with a bias, and capped tiles; the
    # fp8 products at the three tile sizes
    assert plain.count("compiled _skinny_gemm_kernel") == 8
    assert plain.count("'SCALED': True") == 3
    assert plain.count("compiled _gate_up_silu_kernel") == 3  # 16-, 64- and 128-row tiles
