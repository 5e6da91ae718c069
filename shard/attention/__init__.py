"""Attention backends behind a registry: adding one is a new file plus one line in
:data:`ATTENTION_BACKENDS`."""

from __future__ import annotations

from shard.attention.base import AttentionBackend, AttentionSpec
from shard.attention.metadata import AttentionMetadata
from shard.attention.torch_backend import TorchAttentionBackend

# Order matters for "auto": the first that supports the spec wins.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
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
    if spec.block_size % cls.block_size_multiple != 0:
        return False, f"block_size={spec.block_size} is not a multiple of {cls.block_size_multiple}"
    return cls.supports(spec)


def select_backend(name: str, spec: AttentionSpec) -> tuple[AttentionBackend, str]:
    """Instantiate the named backend, or with ``"auto"`` the first that supports ``spec``.

    Returns:
        (backend, reason): reason says why it was chosen and why earlier ones were skipped.

    Raises:
        ValueError: unknown name, or the named backend does not support ``spec``, or
            (auto) none does.
    """
    if name != "auto":
        cls = get_backend_class(name)
        ok, reason = _check(cls, spec)
        if not ok:
            raise ValueError(f"attention backend {name!r} cannot run this model: {reason}")
        return cls(), f"requested: {reason}"
    skipped: list[str] = []
    for cls in ATTENTION_BACKENDS.values():
        ok, reason = _check(cls, spec)
        if ok:
            return cls(), "; ".join([*skipped, f"auto chose {cls.name}: {reason}"])
        skipped.append(f"{cls.name} skipped: {reason}")
    raise ValueError("no attention backend supports this model: " + "; ".join(skipped))
