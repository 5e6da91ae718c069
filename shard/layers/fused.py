"""Small elementwise ops of the decoder layer, fused on CUDA by ``torch.compile``.

A decode step of a 32-layer model runs each of these ~30 times per layer as separate
kernels when eager (RMSNorm alone is six: cast, square, mean, rsqrt, multiply, cast);
at small batch each costs a launch-sized slice of GPU time whatever its size. On CUDA
each function below is compiled (Inductor, ``dynamic=True`` so one compilation serves
every number of tokens) into one or two Triton kernels. Elsewhere, and as the reference
the compiled versions are tested against, the same Python runs eagerly. These are also
the references of our own kernels (:mod:`shard.kernels`), which the layers run instead
where the runner's :class:`~shard.kernels.choices.KernelChoices` has them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from loguru import logger

F_ = TypeVar("F_", bound=Callable[..., Any])

# Each function is compiled once per dtype, rank and 1-vs-many tokens (Dynamo specialises
# on those); a process that serves several models, or a test session, needs more entries
# than Dynamo's default limit of 8 per function.
_RECOMPILE_LIMIT = 64


class _CudaCompiled:
    """Calls ``fn`` compiled when its first argument is a CUDA tensor, eagerly otherwise."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.eager = fn
        self._compiled: Callable[..., Any] | None = None
        self._failed = False
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__

    def __call__(self, *args: Any) -> Any:
        if not args[0].is_cuda or self._failed:
            return self.eager(*args)
        if self._compiled is None:
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, _RECOMPILE_LIMIT)
            self._compiled = torch.compile(self.eager, dynamic=True, fullgraph=True)
        try:
            return self._compiled(*args)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
            # a compile that fails (e.g. past the recompile limit) costs speed, never a
            # request: this function runs eagerly from now on
            logger.warning("{} runs eagerly from now on: compiling it failed ({})",
                           self.__name__, str(exc).splitlines()[0])
            self._failed = True
            return self.eager(*args)


def cuda_compiled(fn: F_) -> F_:
    return _CudaCompiled(fn)  # type: ignore[return-value]


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) with Hugging Face Llama's numerics: normalise in
    float32, cast back to x's dtype, then multiply by the weight.

    Args:
        x: [..., hidden] any float dtype.
        weight: [hidden].

    Returns:
        [..., hidden], x's dtype.
    """
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@cuda_compiled
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then :func:`rms_norm` of the sum.

    Args:
        x, residual: [num_tokens, hidden], same dtype.
        weight: [hidden].

    Returns:
        (normalised sum, sum), both [num_tokens, hidden] in x's dtype.
    """
    total = x + residual
    return rms_norm.eager(total, weight, eps), total  # type: ignore[attr-defined]


@cuda_compiled
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer 2020): ``[..., 2d] = [gate | up] → silu(gate) * up [..., d]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@cuda_compiled
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embeddings (Su et al. 2021, RoFormer) in the ``rotate_half`` convention.

    Args:
        q: [num_tokens, num_heads, head_dim].
        k: [num_tokens, num_kv_heads, head_dim].
        cos, sin: [num_tokens, 1, head_dim], the dtype of q and k.

    Returns:
        (q, k) rotated, same shapes and dtypes.
    """
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
