"""Build the model for a :class:`ShardConfig`: parse config.json, pick the class from
the registry, create parameters directly in the target dtype and device (and sharded
for this rank's :class:`~shard.distributed.ParallelContext`; fp8 where
``--quantization fp8`` asks, :mod:`shard.quantization`), load weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from loguru import logger

from shard.attention.base import AttentionBackend
from shard.config import ShardConfig, dtype_name
from shard.distributed import ParallelContext, parallel_context
from shard.kernels.choices import KernelChoices, kernel_context
from shard.layers.product_weights import pack_cpu_weights
from shard.models.base import CausalLM
from shard.models.config import ModelConfig
from shard.models.registry import get_model_class
from shard.quantization.config import quantization_context, resolve_fp8_weights
from shard.weights import fill_dummy_weights, load_weights


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily create floating tensors in ``dtype`` (restored on exit)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ShardConfig,
    model_config: ModelConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    kernels: KernelChoices | None = None,
) -> CausalLM:
    """Create the model (no KV cache bound yet) and fill its weights. Its layers run the
    kernels of ``kernels`` (:func:`~shard.kernels.choices.kernel_context`; none given:
    the references only).

    Raises:
        ValueError: unsupported architecture, a checkpoint that does not fit the model,
            or a quantization this checkpoint or device cannot have
            (:func:`~shard.quantization.config.resolve_fp8_weights`).
        FileNotFoundError: no safetensors in ``config.model_path`` (safetensors format).
    """
    log = logger.bind(rank=config.rank)
    cls = get_model_class(model_config)
    fp8 = resolve_fp8_weights(config, device)
    log.info(
        "building {} ({} layers, hidden {}, heads {}/{} kv, head_dim {}) in {} on {}",
        model_config.architecture,
        model_config.num_hidden_layers,
        model_config.hidden_size,
        model_config.num_attention_heads,
        model_config.num_key_value_heads,
        model_config.head_dim,
        dtype_name(dtype),
        device,
    )
    tp = ParallelContext(config.rank, config.world_size)
    with torch.device(device), _default_dtype(dtype), parallel_context(tp), \
            kernel_context(kernels if kernels is not None else KernelChoices()), \
            quantization_context(fp8):
        model = cls(model_config, backend)
    model.eval()
    if fp8 is not None:
        log.info("{}", fp8.describe(dtype))
    if config.load_format == "dummy":
        log.info("filling dummy weights (load_format=dummy)")
        fill_dummy_weights(model, dtype=dtype)
    else:
        load_weights(model, config.model_path)
    num_params = sum(p.numel() for _, p in model.named_parameters())
    packed = pack_cpu_weights(model)
    if packed:
        log.info("packed {} float32 CPU weight matrices for oneDNN", packed)
    log.info("model ready: {:.1f}M parameters", num_params / 1e6)
    return model
