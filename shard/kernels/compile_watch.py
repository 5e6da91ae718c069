"""Triton kernels compiled while a shard serves, made loud.

Triton compiles a kernel once per specialization: its constexpr values and, for each
integer argument, whether it is 1 or a multiple of 16 (and pointers' 16-byte alignment).
A step whose sizes reach a variant that warm-up did not run waits for the compiler
(0.2–1 s per kernel on an H100, less when Triton's disk cache has it), and every stream
in the batch stalls with it. Warm-up runs prefills of several shapes for that reason
(:meth:`shard.warmup.Warmup._run_dummy_prefill`); :class:`CompileWatch` counts what
compiles after it and logs each such kernel once, with the specialization that missed.

It hooks ``triton.knobs.runtime.jit_cache_hook`` (Triton >= 3.4), which Triton calls
before it compiles (or loads from its disk cache) a kernel variant this process has not
run yet; without it the watch does nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from loguru import logger

try:
    from triton import knobs as _knobs
except ImportError:  # no Triton (some CPU installs), or one without knobs
    _knobs = None


class CompileWatch:
    """Counts Triton kernel variants first run after :meth:`arm`, logging each.

    Attributes:
        late: ``(kernel, specialization)`` of each variant first run after ``arm``.
    """

    def __init__(self) -> None:
        self.armed = False
        self.late: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._installed = False

    @property
    def available(self) -> bool:
        """Whether this Triton offers the hook."""
        return _knobs is not None and hasattr(_knobs, "runtime") and hasattr(
            _knobs.runtime, "jit_cache_hook")

    def install(self) -> None:
        """Chain the hook in front of any already set (idempotent)."""
        if self._installed or not self.available:
            return
        previous = _knobs.runtime.jit_cache_hook

        def hook(*args: Any, **kwargs: Any) -> Any:
            self._seen(kwargs)
            return previous(*args, **kwargs) if previous is not None else None

        _knobs.runtime.jit_cache_hook = hook
        self._installed = True

    def arm(self) -> None:
        """From now on, a variant not run before is logged as a warning: call at the end
        of warm-up."""
        self.armed = True

    def disarm(self) -> None:
        """Stop logging (a warm-up is under way)."""
        self.armed = False

    def _seen(self, info: dict[str, Any]) -> None:
        if not self.armed:
            return
        fn = info.get("fn")
        name = getattr(fn, "name", None) or str(info.get("repr", "?")).split("[")[0]
        specialization = str(info.get("repr", ""))
        with self._lock:
            self.late.append((name, specialization))
        logger.warning(
            "Triton kernel {} compiled while serving (a variant warm-up did not run; the "
            "step waited for it): {}", name, specialization)


# One per process: Triton's hook is process-wide.
WATCH = CompileWatch()
