"""Copies between host and device that do not make the host wait for the device.

Host lists become device tensors through pinned memory with non-blocking copies
(:func:`to_device`): a plain ``torch.tensor(values, device="cuda")`` copies from
pageable memory and waits for every kernel already queued, which would stop the host
from preparing step N+1 while step N computes.

A decode step ends with one device-to-host copy of its sampled ids (and logprobs). Made
with ``non_blocking=True`` into pinned memory and marked by a CUDA event, the copy is
queued behind the step's kernels and the host only waits when it reads the result
(:meth:`HostCopy.wait`), so it can meanwhile launch the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | list[list[int]] | torch.Tensor,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """``values`` (host lists, or a host tensor) as a tensor of ``dtype`` on ``device``;
    on CUDA through pinned memory with a non-blocking copy, queued on the current stream
    (the host does not wait)."""
    if isinstance(values, torch.Tensor):
        cpu = values.to(dtype)
    else:
        cpu = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Host copies of ``tensors`` (None entries stay None).

    On CUDA the copies go to pinned memory, asynchronously, followed by an event; on
    other devices they are plain copies made at once.
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        cuda = [t for t in tensors if t is not None and t.is_cuda]
        self._event: torch.cuda.Event | None = None
        if not cuda:
            self._host = [None if t is None else t.cpu() for t in tensors]
            return
        self._host = []
        for t in tensors:
            if t is None:
                self._host.append(None)
                continue
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            self._host.append(host)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        """Whether the copies are done (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> list[torch.Tensor | None]:
        """The host tensors, once the copies are done (blocks until then)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
