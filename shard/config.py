"""Shard configuration: one frozen dataclass, validated at construction.

Environment variables (prefix ``SHARDSERVE_``) are read in exactly one place,
:func:`env_overrides`, and only when it is called — never at import time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

ENV_PREFIX = "SHARDSERVE_"
MiB = 1024 * 1024

LoadFormat = Literal["safetensors", "dummy"]
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ShardConfig:
    """Everything one shard needs to start.

    Attributes:
        model_path: Hugging Face model folder (config.json + safetensors). With
            ``load_format="dummy"`` only config.json is read.
        model_id: Name reported by ``Info``; defaults to ``model_path``.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 on CPU), ``"float32"``,
            ``"bfloat16"`` or ``"float16"``.
        device: ``"auto"`` (cuda if available, else cpu), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        block_size: Tokens per KV block; must suit the attention backend.
        kv_cache_bytes: KV cache budget on CPU, in bytes (all layers, K and V).
        gpu_memory_fraction: Fraction of total GPU memory the shard may use
            (weights + activations + KV cache), in (0, 1].
        attention_backend: Registry name (see :mod:`shard.attention`), or ``"auto"``.
        cuda_graphs: Decode batch sizes captured as CUDA graphs at warmup: ``"auto"``
            (1, 2, 4, 8, then multiples of 16 up to the max batch size), ``"0"`` (off), or
            comma-separated sizes such as ``"1,2,4,8,16,32"``. CUDA only.
        rank: Tensor-parallel rank of this shard, in [0, world_size).
        world_size: Tensor-parallel world size.
        load_format: ``"safetensors"`` reads the checkpoint; ``"dummy"`` fills
            random weights from config.json alone (benchmarks).
        json_logs: Log JSON lines instead of readable ones.
        master_addr: IP of rank 0, where the process group meets (world_size > 1).
        master_port: Free TCP port on ``master_addr`` for the rendezvous; 0 = unset
            (required when world_size > 1).

    Raises:
        ValueError: on any invalid field, naming it.
    """

    model_path: str
    model_id: str = ""
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int = 512 * MiB
    gpu_memory_fraction: float = 0.9
    attention_backend: str = "auto"
    cuda_graphs: str = "auto"
    rank: int = 0
    world_size: int = 1
    load_format: LoadFormat = "safetensors"
    json_logs: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path must be set")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535], got {self.master_port}")
        if self.world_size > 1 and self.master_port == 0:
            raise ValueError("master_port must be set when world_size > 1")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(
                f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}"
            )

    @property
    def served_model_id(self) -> str:
        """The model id reported by ``Info``: ``model_id`` or else ``model_path``."""
        return self.model_id or self.model_path

    def torch_device(self) -> torch.device:
        """Resolve ``device`` ("auto" → cuda when available, else cpu; with several
        visible GPUs and world_size > 1, rank r takes ``cuda:r``)."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and self.world_size > 1 and torch.cuda.device_count() > 1:
            # Plain processes on one host see every GPU: one per rank. (Ray actors see
            # only their own GPU, so they stay on cuda:0.)
            return torch.device(f"cuda:{self.rank % torch.cuda.device_count()}")
        return torch.device(device)

    def torch_dtype(self) -> torch.dtype:
        """Resolve ``dtype`` ("auto" → bfloat16 on CUDA, float32 on CPU)."""
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling used by ``Info``)."""
    return str(dtype).removeprefix("torch.")


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Read ``SHARDSERVE_<FIELD>`` variables for :class:`ShardConfig` fields.

    This is the only function in shardserve's shard that reads the environment.

    Args:
        environ: Mapping to read; ``os.environ`` when None.

    Returns:
        ``{field_name: value}`` converted to the field's type, only for variables set,
        e.g. ``SHARDSERVE_ATTENTION_BACKEND=torch`` → ``{"attention_backend": "torch"}``.

    Raises:
        ValueError: when a value does not parse as the field's type (names the variable).
    """
    env = os.environ if environ is None else environ
    out: dict[str, object] = {}
    for field in dataclasses.fields(ShardConfig):
        key = ENV_PREFIX + field.name.upper()
        if key not in env:
            continue
        raw = env[key]
        try:
            if field.name in ("block_size", "kv_cache_bytes", "rank", "world_size", "master_port"):
                out[field.name] = int(raw)
            elif field.name == "gpu_memory_fraction":
                out[field.name] = float(raw)
            else:
                out[field.name] = raw
        except ValueError as exc:
            raise ValueError(f"{key}={raw!r} is not a valid {field.name}: {exc}") from exc
    return out
