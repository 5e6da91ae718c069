"""Which of our kernels one runner's model runs, held by one object
(:class:`KernelChoices`), never by module globals: made when the runner is built
(:meth:`KernelChoices.load`), its GEMM table filled at warm-up
(:func:`shard.kernels.gemm_tuning.tune`), and read by the layers, the attention backend,
the decode CUDA graphs and the greedy sampler.

Each Triton kernel is used only on CUDA where Triton imports; elsewhere its field is None
and the caller runs the reference (PyTorch ops, compiled on CUDA by
:mod:`shard.layers.fused`). A kernel also declines the inputs it does not take (it
returns None), and the caller runs the reference for those.

The layers take the object of the model being built (:func:`kernel_context`, as they
take their tensor-parallel rank from :func:`shard.distributed.parallel_context`); a layer
built outside one runs the references only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger

from shard.kernels.fp8_tuning import Fp8Table
from shard.kernels.gemm_tuning import GemmTable

# The kernel fields that :meth:`KernelChoices.disabled` may turn off.
KERNELS = ("skinny_linear", "skinny_fp8_linear", "gate_up_silu", "add_rms_norm",
           "silu_and_mul", "greedy", "add_rms_norm_fp8", "silu_and_mul_fp8")


@dataclass
class KernelChoices:
    """The kernels one runner's model runs.

    Attributes:
        pdl: our Triton kernels launch with programmatic dependent launch
            (:mod:`shard.kernels.pdl`; ``--pdl auto`` where it runs).
        skinny_linear: :func:`shard.kernels.skinny_gemm.skinny_linear`, the products of
            up to 16 rows (:mod:`shard.layers.linear`), or None.
        gate_up_silu: :func:`shard.kernels.gate_up_silu.gate_up_silu`, an MLP's gate/up
            product with SwiGLU at decode sizes, or None.
        add_rms_norm: :func:`shard.kernels.rms_norm.add_rms_norm`, or None.
        silu_and_mul: :func:`shard.kernels.silu_mul.silu_and_mul`, or None.
        add_rms_norm_fp8, silu_and_mul_fp8: the same ops writing their rows quantized
            per token before an fp8 product (:func:`shard.kernels.rms_norm.add_rms_norm_fp8`,
            :func:`shard.kernels.silu_mul.silu_and_mul_fp8`), or None.
        greedy: :func:`shard.kernels.greedy.greedy`, or None (also once its first call
            failed: see :meth:`greedy_sample`).
        greedy_worked: the greedy kernel's first call succeeded.
        gemms: the cuBLASLt algorithm of each product shape and row count, tuned at
            warm-up (empty: ``F.linear`` everywhere).
        fp8_gemms: the fp8 products of a few rows measured faster through
            ``torch._scaled_mm`` than through ``skinny_fp8_linear`` at warm-up
            (:mod:`shard.kernels.fp8_tuning`).
    """

    pdl: bool = False
    skinny_linear: Callable[..., torch.Tensor | None] | None = None
    skinny_fp8_linear: Callable[..., torch.Tensor | None] | None = None
    gate_up_silu: Callable[..., torch.Tensor | None] | None = None
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None] | None = None
    silu_and_mul: Callable[..., torch.Tensor] | None = None
    add_rms_norm_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor,
                                          torch.Tensor | None] | None] | None = None
    silu_and_mul_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    greedy: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    greedy_worked: bool = False
    gemms: GemmTable = field(default_factory=GemmTable)
    fp8_gemms: Fp8Table = field(default_factory=Fp8Table)

    @classmethod
    def load(cls, device: torch.device, pdl: str = "auto", log: Any = None) -> KernelChoices:
        """Our kernels for ``device``: every Triton kernel on CUDA where Triton imports
        (none elsewhere), launched with PDL per ``pdl`` (``--pdl``: ``"auto"``, where it
        runs, or ``"off"``), which is logged on ``log``; no tuned product yet."""
        if device.type != "cuda":
            return cls()
        try:
            from shard.kernels import gate_up_silu, greedy, rms_norm, silu_mul, skinny_gemm
            from shard.kernels import pdl as launch
        except ImportError:  # no Triton: the references everywhere
            return cls()
        on = pdl == "auto" and launch.available(device)
        if log is not None:
            why = ("--pdl off" if pdl == "off" else "compute capability 9.0+" if on else
                   "not supported here: it needs an NVIDIA GPU of compute capability 9.0+ "
                   "and Triton's gdc_wait, outside Triton's interpreter")
            log.info("programmatic dependent launch {} ({})", "on" if on else "off", why)
        return cls(pdl=on, skinny_linear=skinny_gemm.skinny_linear,
                   skinny_fp8_linear=skinny_gemm.skinny_fp8_linear,
                   gate_up_silu=gate_up_silu.gate_up_silu, add_rms_norm=rms_norm.add_rms_norm,
                   silu_and_mul=silu_mul.silu_and_mul, greedy=greedy.greedy,
                   add_rms_norm_fp8=rms_norm.add_rms_norm_fp8,
                   silu_and_mul_fp8=silu_mul.silu_and_mul_fp8)

    def fp8_product(self, x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
        """The fp8 product ``(x_q · x_scale) (weight · weight_scale)^T`` through the skinny
        kernel where it takes the inputs and warm-up did not measure ``torch._scaled_mm``
        faster for the shape and row count (:class:`~shard.kernels.fp8_tuning.Fp8Table`);
        else None (the caller runs ``torch._scaled_mm``). Arguments as
        :func:`shard.kernels.skinny_gemm.skinny_fp8_linear`'s."""
        kernel = self.skinny_fp8_linear
        if kernel is None or not self.fp8_gemms.skinny(x_q.shape[0], *weight.shape):
            return None
        return kernel(x_q, x_scale, weight, weight_scale, out_dtype, pdl=self.pdl)

    def greedy_sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The greedy kernel's (token ids [batch] int64, logprobs [batch] float32) for
        ``logits`` [batch, vocab], or None when it cannot run here. Its first call (made
        at warm-up) decides: a failure then is logged and the kernel dropped (the torch
        ops serve from then on); a failure after it has run once is an error of that step
        and propagates."""
        kernel = self.greedy
        if kernel is None:
            return None
        try:
            out = kernel(logits, pdl=self.pdl)
        except Exception as exc:  # a compile error is not a RuntimeError
            if self.greedy_worked:
                raise
            logger.warning("greedy sampling kernel unavailable, using torch ops: {}: {}",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.greedy = None
            return None
        self.greedy_worked = True
        return out

    @contextlib.contextmanager
    def disabled(self, *names: str) -> Iterator[None]:
        """Inside the block the kernels ``names`` (of :data:`KERNELS`) are not used: their
        callers run the references (tests and A/B measurements; not thread-safe).

        Raises:
            ValueError: a name not in :data:`KERNELS`.
        """
        unknown = [name for name in names if name not in KERNELS]
        if unknown:
            raise ValueError(f"unknown kernels {unknown}; valid: {', '.join(KERNELS)}")
        saved = {name: getattr(self, name) for name in names}
        for name in names:
            setattr(self, name, None)
        try:
            yield
        finally:
            for name, kernel in saved.items():
                setattr(self, name, kernel)


def gate_up_silu_rows(dtype: torch.dtype) -> range:
    """Row counts (tokens) at which :func:`shard.kernels.gate_up_silu.gate_up_silu` takes a
    gate/up weight of ``dtype``: its ``MIN_ROWS``..``MAX_ROWS``, or none for a dtype it
    does not take. Imports the kernel (Triton)."""
    from shard.kernels import gate_up_silu

    if dtype not in gate_up_silu.DTYPES:
        return range(0)
    return range(gate_up_silu.MIN_ROWS, gate_up_silu.MAX_ROWS + 1)


_building: ContextVar[KernelChoices | None] = ContextVar("kernel_choices", default=None)


@contextlib.contextmanager
def kernel_context(choices: KernelChoices) -> Iterator[KernelChoices]:
    """Layers constructed inside the block take ``choices`` (:func:`current_kernels`)."""
    token = _building.set(choices)
    try:
        yield choices
    finally:
        _building.reset(token)


def current_kernels() -> KernelChoices:
    """The choices of the model being built (:func:`kernel_context`); outside one, a
    fresh object with no kernel of ours (the references)."""
    choices = _building.get()
    return choices if choices is not None else KernelChoices()
