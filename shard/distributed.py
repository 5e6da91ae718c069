"""The tensor-parallel process group of one shard group, and the collectives the
parallel layers use.

Every rank of a shard group calls :func:`init_distributed` once at start-up (before the
model is built) with the rendezvous the launcher handed over (``--master-addr`` /
``--master-port``); gloo is used on CPU, NCCL on CUDA.

The parallel layers learn their rank from one :class:`ParallelContext`: the model is
built inside :func:`parallel_context`, each layer takes :func:`current_parallel` when it
is constructed and calls the context's collectives, which are no-ops at world size 1 (a
single shard never needs ``torch.distributed``). The model code itself never sees a rank.

The tensor-parallel layout (which dimension each layer splits, where the collectives
sit) follows Megatron-LM: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", §3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from loguru import logger

# A rank that died leaves the others inside a collective: gloo/NCCL raise after this
# long instead of hanging forever (the launcher restarts the group well before).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def backend_for(device: torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device
) -> None:
    """Join the shard group's process group (blocks until every rank has joined).

    Args:
        rank: this rank, in [0, world_size).
        world_size: ranks in the group; 1 creates no process group.
        master_addr: IP or host name of rank 0.
        master_port: free TCP port on ``master_addr`` for the rendezvous store.
        device: this rank's device; picks the backend (:func:`backend_for`) and, on
            CUDA, becomes the current device.

    Raises:
        RuntimeError: the rendezvous failed or timed out.
    """
    if world_size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logger.bind(rank=rank).info(
        "joining the {} process group: rank {}/{} at {}:{}",
        backend, rank, world_size, master_addr, master_port,
    )
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    # One collective now: every rank is connected before the model loads.
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    assert int(probe.item()) == world_size, f"process group probe gave {probe.item()}"


def destroy_distributed() -> None:
    """Leave the process group, if any (safe to call more than once)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in its tensor-parallel group, and the group's collectives.

    Attributes:
        rank: this rank, in [0, size).
        size: ranks in the group (the tensor-parallel world size), >= 1.

    Raises:
        ValueError: size < 1 or rank outside [0, size).
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place); identity at size 1.

        Shape and dtype are unchanged.
        """
        if self.size == 1:
            return x
        dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x [n, d]`` along the last dimension, in rank order:
        ``[n, d] → [n, d * size]`` on every rank; identity at size 1."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = ParallelContext()
_CURRENT: ContextVar[ParallelContext] = ContextVar("parallel_context", default=SINGLE_RANK)


def current_parallel() -> ParallelContext:
    """The context set by the innermost :func:`parallel_context` (a single rank outside
    any)."""
    return _CURRENT.get()


@contextlib.contextmanager
def parallel_context(ctx: ParallelContext) -> Iterator[ParallelContext]:
    """Build layers for ``ctx`` inside this block (the previous context is restored on
    exit)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
