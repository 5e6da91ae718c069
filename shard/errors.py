"""Shard errors that the servicer maps to specific gRPC status codes (see
:mod:`shard.servicer`). Plain ``ValueError`` means a bad request (INVALID_ARGUMENT)."""

from __future__ import annotations


class NotWarmedUpError(RuntimeError):
    """Prefill/Decode before Warmup allocated the KV cache (FAILED_PRECONDITION)."""


class KVCacheTooSmallError(ValueError):
    """The KV cache cannot hold the requested budgets; the message names the flag to change."""
