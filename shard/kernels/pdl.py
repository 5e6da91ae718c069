"""Programmatic dependent launch (PDL) for our Triton kernels (CUDA, sm_90 and later).

A kernel launched with PDL may be scheduled while the kernel before it in the stream
still runs, on the SMs that kernel leaves free: its launch and its programs' start
overlap the previous kernel's tail instead of following it. Each of our kernels takes a
``USE_PDL`` constexpr and, when it is set, calls :func:`pdl_start` before it touches
memory: ``griddepcontrol.wait`` (returns once the previous grid has completed and its
writes are visible), then ``griddepcontrol.launch_dependents`` (the next grid may be
scheduled once every program of this one has called it or exited, i.e. from its last
wave on). Since every such kernel waits before reading or writing anything, none
completes before the kernel ahead of it, so the stream's order holds transitively; a
kernel launched without PDL (cuBLAS, NCCL, PyTorch's own) still waits for the whole
previous kernel, and a PDL kernel behind one starts only when it completes: the overlap
is between our kernels. Stream capture records the launches as programmatic edges of the
CUDA graph.

Whether a launch uses it is the caller's choice, held by the runner's
:class:`~shard.kernels.choices.KernelChoices` (``--pdl auto``: on where it runs, an
NVIDIA GPU (not ROCm) of compute capability 9.0 or more, Triton with
``triton.language.extra.cuda.gdc_wait``, kernels not run by Triton's interpreter;
``--pdl off``: never): each kernel wrapper takes ``pdl`` and passes
:func:`launch_options` to its launch.

Sources: CUDA C++ Programming Guide, "Programmatic Dependent Launch and
Synchronization"; PTX ISA, ``griddepcontrol``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """The first statement of a kernel launched with :func:`launch_options`."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``), which has
    no grid dependency control."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _supported(device_index: int) -> bool:
    if torch.version.hip is not None:  # griddepcontrol is NVIDIA PTX
        return False
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` can use PDL (see the module doc)."""
    if device.type != "cuda" or _interpreted():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _supported(index)


def launch_options(device: torch.device, pdl: bool) -> dict[str, bool]:
    """Keyword arguments for a kernel launch on ``device``: ``USE_PDL`` (the kernel's
    constexpr) and, when it is set (``pdl`` asked and :func:`available`), Triton's
    ``launch_pdl``."""
    if pdl and available(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
