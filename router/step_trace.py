"""Timestamps of each decode step's hops through the router, for finding where the
device waits (``benchmarks/steps/step_chain.py`` reads them beside the shards' own, which
each shard writes itself: the router's trace is not part of the router ↔ shard
contract).

Off unless ``--step-trace-dir`` names a folder: :func:`step_trace` then gives a
:class:`~shard.step_trace.StepTrace` (the same file writer the shards use: rows of
``(point, step, monotonic ns, value)`` in ``<dir>/<pid>.tsv``), otherwise a
:class:`~shard.step_trace.NullTrace`, whose marks do nothing. Only the writer is shared:
no step message carries a trace, and the router's marks are its own.

Points (``step``: the step number the router gives each Prefill and Decode): ``send``
(a Decode is sent; carries the rows it steps), ``recv`` (its response is read),
``applied`` (its tokens are taken in and the next step can be scheduled).
"""

from __future__ import annotations

from shard.step_trace import NullTrace, StepTrace, Trace

__all__ = ["NullTrace", "StepTrace", "Trace", "step_trace"]


def step_trace(folder: str) -> Trace:
    """A :class:`StepTrace` into ``folder``, or a :class:`NullTrace` when it is empty."""
    return StepTrace(folder) if folder else NullTrace()
