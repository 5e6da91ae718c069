"""The test session itself: a pytest run that loaded triton ends with pytest's summary,
not with libtriton's nanobind leak report (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A test that leaves one libtriton object alive when the interpreter ends, as a grpc.aio
# server and a warmed-up model runner do in tests/unit/shard/test_servicer.py.
LEAKING_TEST = '''
import ctypes

import triton._C.libtriton as libtriton


def test_leaves_a_triton_object_alive() -> None:
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(libtriton.ir.context()))
'''


def run_pytest(folder: Path, *plugins: str) -> subprocess.CompletedProcess[str]:
    args = [arg for plugin in plugins for arg in ("-p", plugin)]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
         str(folder / "test_leak.py")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )


def test_a_session_that_loaded_triton_ends_with_its_summary(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    (tmp_path / "test_leak.py").write_text(LEAKING_TEST)
    bare = run_pytest(tmp_path)
    assert "nanobind: leaked" in bare.stderr, bare.stderr  # what the conftest hides

    ours = run_pytest(tmp_path, "tests.conftest")
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert ours.stdout.rstrip().splitlines()[-1].startswith("1 passed"), ours.stdout
    assert "leaked" not in ours.stdout + ours.stderr, ours.stderr
