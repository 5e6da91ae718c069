"""The tensor-parallel process group of one shard group, and the collectives the
parallel layers use.

Every rank of a shard group calls :func:`init_distributed` once at start-up (before the
model is built) with the rendezvous the launcher handed over (``--master-addr`` /
``--master-port``); gloo is used on CPU, NCCL on CUDA. The layers then call
:func:`all_reduce` / :func:`all_gather`, which are no-ops at world size 1, so a single
shard never needs ``torch.distributed``.

The tensor-parallel layout (which dimension each layer splits, where the collectives
sit) follows Megatron-LM: Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", §3.
"""

from __future__ import annotations

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


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the ranks (in place); identity when ``tp_size == 1``.

    Shape and dtype are unchanged.
    """
    if tp_size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate every rank's ``x [n, d]`` along the last dimension, in rank order:
    ``[n, d] → [n, d * tp_size]`` on every rank; identity when ``tp_size == 1``."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)
