"""Shard errors that the servicer maps to specific gRPC status codes (see
:mod:`shard.servicer`). Plain ``ValueError`` means a bad request (INVALID_ARGUMENT)."""

from __future__ import annotations


class UnknownBatchError(KeyError):
    """A batch id that the shard does not hold (NOT_FOUND)."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(batch_id)
        self.batch_id = batch_id

    def __str__(self) -> str:
        return f"unknown batch id {self.batch_id}"


class NotWarmedUpError(RuntimeError):
    """Prefill/Decode before Warmup allocated the KV cache (FAILED_PRECONDITION)."""


class KVCacheTooSmallError(ValueError):
    """The KV cache cannot hold the requested budgets; the message names the flag to change."""
