"""Which weights and caches are quantized, and how: resolved once at start-up from the
flags (``--quantization``, ``--kv-cache-dtype``) and the checkpoint's
``quantization_config``, checked against the device, and handed to the layers built
for the model (:func:`quantization_context`, as :func:`shard.distributed.parallel_context`
hands them their rank).

Pre-quantized checkpoints: the Hugging Face ``quantization_config`` with
``quant_method: "fp8"`` (as written by AutoFP8 / llm-compressor's ``fp8`` export and
read by vLLM and transformers' ``FineGrainedFP8``-less path): e4m3 ``weight`` tensors,
a ``weight_scale`` per tensor (scalar) or per output channel (``[out]`` or
``[out, 1]``), and with ``activation_scheme: "static"`` an ``input_scale`` scalar per
layer (``"dynamic"``: none, activations are quantized per token). Block-wise scales
(``weight_block_size``) are refused.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shard.config import ShardConfig

# The compute capability of the first NVIDIA GPUs with fp8 tensor cores (Ada, sm89;
# Hopper is sm90), which Triton's e4m3 conversions need too.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Fp8Weights:
    """How the decoder layers' fp8 weights are obtained.

    Attributes:
        from_checkpoint: the checkpoint holds e4m3 weights and their ``weight_scale``
            (read as they are); False: quantized at load from a bf16/fp16/fp32
            checkpoint (or dummy weights), per output channel.
        static_activations: the checkpoint gives each layer an ``input_scale`` (one
            per tensor, static); False: activations quantized per token at run time.
    """

    from_checkpoint: bool = False
    static_activations: bool = False

    def describe(self, model_dtype: torch.dtype) -> str:
        """One line for the start-up log and ``Info``: what is quantized and how."""
        source = (
            "read from the fp8 checkpoint (its weight_scale per tensor or per "
            "channel, applied per output channel)"
            if self.from_checkpoint
            else "quantized at load with one scale per output channel, chosen by squared error"
        )
        acts = (
            "static per-tensor scales from the checkpoint"
            if self.static_activations
            else "per-token scales computed at run time"
        )
        dtype = str(model_dtype).removeprefix("torch.")
        return (
            f"fp8 weights: the decoder layers' linear weights in float8_e4m3fn, {source}; "
            f"activations quantized to e4m3 with {acts}; products via torch._scaled_mm "
            f"(up to 16 rows: our skinny kernel unless warm-up measured it slower); "
            f"embeddings, LM head and norms stay {dtype}"
        )


def checkpoint_quantization(model_path: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``<model_path>/config.json``, or None."""
    with open(Path(model_path) / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    found = config.get("quantization_config")
    return dict(found) if found else None


def check_fp8_device(device: torch.device, flag: str) -> None:
    """Raise unless ``device`` runs fp8: the CPU (reference kernels, for tests), or an
    NVIDIA GPU of compute capability 8.9+.

    Raises:
        ValueError: naming ``flag`` (e.g. ``"--quantization fp8"``) and the GPU.
    """
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{flag} needs fp8 tensor cores: an NVIDIA GPU of compute capability 8.9+ "
            f"(Ada, Hopper); {name} is sm{capability[0]}{capability[1]}"
        )


def resolve_fp8_weights(config: ShardConfig, device: torch.device) -> Fp8Weights | None:
    """The fp8 weights ``config`` asks for (None: unquantized), from ``--quantization``
    and the checkpoint's ``quantization_config``.

    Raises:
        ValueError: an fp8 checkpoint without ``--quantization fp8``, a checkpoint
            quantized by another method, block-wise fp8 scales, or a GPU without fp8
            (see :func:`check_fp8_device`).
    """
    found = None if config.load_format == "dummy" else checkpoint_quantization(config.model_path)
    method = None if found is None else str(found.get("quant_method", ""))
    if config.quantization == "none":
        if method == "fp8":
            raise ValueError(
                f"the checkpoint at {config.model_path} holds fp8 weights "
                "(quantization_config.quant_method = fp8): start with --quantization fp8"
            )
        return None
    check_fp8_device(device, "--quantization fp8")
    if found is None:
        return Fp8Weights()
    if method != "fp8":
        raise ValueError(
            f"--quantization fp8 cannot read a checkpoint quantized with {method!r} "
            f"(quantization_config.quant_method); it reads unquantized checkpoints and "
            f"quant_method fp8 ones"
        )
    if found.get("weight_block_size"):
        raise ValueError(
            "--quantization fp8 does not read block-wise fp8 scales "
            f"(quantization_config.weight_block_size = {found['weight_block_size']}); "
            "per-tensor and per-channel weight_scale only"
        )
    scheme = str(found.get("activation_scheme", "dynamic"))
    if scheme not in ("static", "dynamic"):
        raise ValueError(
            f"unknown quantization_config.activation_scheme {scheme!r}: static or dynamic"
        )
    return Fp8Weights(from_checkpoint=True, static_activations=scheme == "static")


def resolve_kv_cache_dtype(
    config: ShardConfig, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's dtype: the model's (``--kv-cache-dtype auto``) or float8_e4m3fn.

    Raises:
        ValueError: fp8 on a GPU without fp8 (see :func:`check_fp8_device`).
    """
    if config.kv_cache_dtype == "auto":
        return model_dtype
    check_fp8_device(device, "--kv-cache-dtype fp8")
    return torch.float8_e4m3fn


_building: ContextVar[Fp8Weights | None] = ContextVar("fp8_weights", default=None)


@contextlib.contextmanager
def quantization_context(fp8: Fp8Weights | None) -> Iterator[None]:
    """Linear layers constructed inside the block hold fp8 weights when ``fp8`` is set
    (:func:`current_fp8_weights`)."""
    token = _building.set(fp8)
    try:
        yield
    finally:
        _building.reset(token)


def current_fp8_weights() -> Fp8Weights | None:
    """The fp8 weights of the model being built (:func:`quantization_context`); None
    outside one or for an unquantized model."""
    return _building.get()
