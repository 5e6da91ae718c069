"""Worker threads for request preparation that would otherwise stop the event loop.

Tokenizing a prompt near ``--max-request-bytes`` (and rendering a chat template around
it) takes up to seconds of CPU; on the event loop that also drives generation, every
running stream would stop for that long. Every API layer (TGI, OpenAI, public gRPC)
runs that work here instead. The tokenizer releases the GIL while it encodes (see
:meth:`router.tokenizer.Tokenizer.encoding`), so the loop keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Offload:
    """A small pool of threads for CPU-bound request preparation.

    Args:
        max_workers: Threads; default ``min(4, CPU count)``.
    """

    def __init__(self, max_workers: int | None = None) -> None:
        workers = max_workers or min(4, os.cpu_count() or 1)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="prepare")

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` in a worker thread; its exception is raised here.

        Cancelling the caller does not stop the thread: the call finishes in the
        background and its result is dropped.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Let the threads exit once their current work is done."""
        self._executor.shutdown(wait=False, cancel_futures=True)
