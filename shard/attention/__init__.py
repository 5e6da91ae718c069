"""Attention backends behind a registry: adding one is a new file plus one line in
:data:`ATTENTION_BACKENDS`.

Every backend module imports without its optional package (flash-attn, FlashInfer,
Triton); a backend whose package is missing reports that from ``supports`` and ``auto``
skips it.
"""

from __future__ import annotations

import dataclasses

from shard.attention.base import AttentionBackend, AttentionSpec
from shard.attention.flash_attn_backend import FlashAttnBackend
from shard.attention.flashinfer_backend import FlashInferBackend
from shard.attention.metadata import AttentionMetadata
from shard.attention.torch_backend import TorchAttentionBackend
from shard.attention.triton_backend import TritonAttentionBackend
from shard.kernels.choices import KernelChoices

# Order matters for "auto": the first that supports the spec wins. Our Triton kernels
# come first: on the H200 their paged decode beat flash-attn 2.8.3 and FlashInfer 0.5.3
# at every point measured (benchmarks/results/attention-h200.md), and they run inside the
# decode CUDA graphs at any block size (flash-attn's paged API needs 256-token blocks).
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TritonAttentionBackend.name: TritonAttentionBackend,
    FlashAttnBackend.name: FlashAttnBackend,
    FlashInferBackend.name: FlashInferBackend,
    TorchAttentionBackend.name: TorchAttentionBackend,
}

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionSpec",
    "get_backend_class",
    "select_backend",
]


def get_backend_class(name: str) -> type[AttentionBackend]:
    """Look up a backend by name.

    Raises:
        ValueError: on an unknown name, listing the valid ones.
    """
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        valid = ", ".join(["auto", *ATTENTION_BACKENDS])
        raise ValueError(f"unknown attention backend {name!r}; valid: {valid}") from None


def _check(cls: type[AttentionBackend], spec: AttentionSpec) -> tuple[bool, str]:
    """Whether ``cls`` runs ``spec`` at the block size it would use (see
    :meth:`AttentionBackend.kv_block_size`). Any exception from a backend's probe counts
    as "cannot run" so a broken optional install never crashes start-up."""
    # Grouped-query attention needs whole groups, whatever the backend.
    if spec.num_heads % spec.num_kv_heads != 0:
        return False, (
            f"num_heads={spec.num_heads} not a multiple of num_kv_heads={spec.num_kv_heads}"
        )
    block_size = cls.kv_block_size(spec.block_size)
    try:
        ok, reason = cls.supports(dataclasses.replace(spec, block_size=block_size))
    except Exception as exc:  # NOTE: a probe of an optional package may raise anything
        return False, f"probe failed: {type(exc).__name__}: {exc}"
    if ok and block_size != spec.block_size:
        reason += f"; block size {spec.block_size} raised to {block_size}"
    return ok, reason


def select_backend(
    name: str, spec: AttentionSpec, kernels: KernelChoices | None = None
) -> tuple[AttentionBackend, str]:
    """Instantiate the named backend, or with ``"auto"`` the first of
    :data:`ATTENTION_BACKENDS` (triton → flash_attn → flashinfer → torch) that imports and
    supports ``spec`` (device, dtype, heads, head size, block size), with the runner's
    ``kernels`` (see :class:`AttentionBackend`).

    The block size the chosen backend needs is ``backend.kv_block_size(spec.block_size)``.

    Returns:
        (backend, reason): reason says why it was chosen and why earlier ones were skipped.

    Raises:
        ValueError: unknown name, or the named backend cannot run ``spec`` (a start-up
            error, never a silent switch), or (auto) none can.
    """
    if name != "auto":
        cls = get_backend_class(name)
        ok, reason = _check(cls, spec)
        if not ok:
            raise ValueError(f"attention backend {name!r} cannot run this model: {reason}")
        return cls(kernels=kernels), f"requested: {reason}"
    skipped: list[str] = []
    for cls in ATTENTION_BACKENDS.values():
        ok, reason = _check(cls, spec)
        if ok:
            return cls(kernels=kernels), "; ".join([*skipped, f"auto chose {cls.name}: {reason}"])
        skipped.append(f"{cls.name} skipped: {reason}")
    raise ValueError("no attention backend supports this model: " + "; ".join(skipped))
