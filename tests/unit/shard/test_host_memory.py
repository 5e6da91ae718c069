"""The CPU shard's malloc settings (:mod:`shard.host_memory`): a block of tens of MB is
served from the heap, and its pages stay mapped after ``free``, instead of a mapping of
its own made and unmapped each time (a fresh process for each case: the settings and
glibc's own adjustments are per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shard.host_memory import is_glibc

pytestmark = pytest.mark.skipif(not is_glibc(), reason="glibc only")

# mallinfo2 (glibc >= 2.33): hblkhd = bytes in mmapped blocks, fordblks = free heap bytes
PROBE = """
import ctypes, json, sys
from shard.host_memory import retain_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None)); sys.exit()
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
took = retain_freed_memory() if sys.argv[1] == "on" else None
size = 20 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
mapped = libc.mallinfo2().hblkhd
libc.free(block)
print(json.dumps({"took": took, "mapped": mapped, "free_in_heap": libc.mallinfo2().fordblks}))
"""


def _probe(mode: str) -> dict[str, int] | None:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True,
                         text=True).stdout
    result: dict[str, int] | None = json.loads(out)
    return result


def test_large_blocks_come_from_the_heap_and_stay_mapped() -> None:
    default, retained = _probe("off"), _probe("on")
    if default is None or retained is None:
        pytest.skip("glibc without mallinfo2")
    size = 20 << 20
    assert retained["took"]
    # glibc's default: a block of its own, unmapped at free
    assert default["mapped"] >= size and default["free_in_heap"] < size
    # with the settings: from the heap, which keeps the freed pages
    assert retained["mapped"] < size and retained["free_in_heap"] >= size
