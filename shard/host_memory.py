"""The C library's allocator settings for a shard that computes on the CPU.

PyTorch's CPU tensors come straight from ``malloc`` (no caching allocator as on CUDA),
and glibc's ``malloc`` serves a block above its mmap threshold (128 KiB at start, raised
only as such blocks are freed) as a mapping of its own, unmapped again by ``free``, and
hands the free top of a heap back to the kernel beyond its trim threshold. A prefill's
activations are such blocks, one or more per op, so each op of a prefill touched fresh
pages that the kernel zero-fills on first access: ~150k minor page faults per
2,400-token prefill of SmolLM2-135M on one EPYC core, 8-10% of its time (2026-12-03).
With the thresholds below, blocks under 32 MiB come from the heap and up to 1 GiB of
freed heap stays mapped, so a step reuses the pages of the steps before it (tens of
faults per prefill). The cost: the process keeps the memory of its largest step.

Source of the settings: glibc's ``mallopt(3)`` (``M_MMAP_THRESHOLD``,
``M_TRIM_THRESHOLD``; setting either turns off their dynamic adjustment).
"""

from __future__ import annotations

import ctypes
import platform

# mallopt(3) parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit systems
TRIM_THRESHOLD_BYTES = 1 << 30


def is_glibc() -> bool:
    """Whether this process runs on Linux with glibc (where the settings apply)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def retain_freed_memory() -> bool:
    """Apply the thresholds above to this process's ``malloc``.

    Returns:
        True when both settings took; False where the C library is not glibc (nothing
        is changed there).
    """
    if not is_glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success, 0 on error (e.g. a value out of range)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
