"""Paged KV cache storage.

Per layer two tensors (key and value) of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``j`` of a request with
block table ``bt`` lives at slot ``bt[j // block_size] * block_size + j % block_size``.
The router decides which blocks a request gets; the shard only reads and writes them.

Two memory layouts carry that shape. Token-major (the default, contiguous; what the GPU
kernels take): the KV heads of one slot lie together. Head-major (``head_major=True``):
the tensors are views of ``[num_kv_heads, num_blocks, block_size, head_dim]`` storage,
so each KV head's slots lie together and a run of consecutive blocks is one contiguous
``[seq_len, head_dim]`` stretch per head, the layout the CPU attention kernel reads
fastest (see :meth:`TorchAttentionBackend.kv_head_major`).

FP8 (``--kv-cache-dtype fp8``): keys and values in float8 e4m3 (token-major only), each
head vector of each token with its own float32 scale, ``amax(|x|) / 448`` over its
head_dim values, in ``key_scale`` / ``value_scale`` [num_blocks, block_size,
num_kv_heads]; a value is read as ``q * scale``. Per token and head, computed as the
token is written, rather than per tensor or per head with fixed scales:

- nothing to calibrate: a per-tensor or per-head scale must be known before the first
  token is written (the cache cannot be rescaled later), so it comes from a calibration
  pass or the checkpoint (vLLM's ``k_scale``/``v_scale``; 1.0 when a checkpoint has
  none); ours comes from the values themselves;
- no value saturates and none sinks into e4m3's subnormals (below 2^-6 x scale, where the
  relative error grows past 2^-4): heads and tokens differ in magnitude by orders (keys
  of a few outlier channels), and each gets the full 3-bit mantissa;
- it costs 4 bytes per head vector: 3% of an fp8 block at head_dim 128 (the cache holds
  1.94x the tokens of a bfloat16 one), 6% at 64 (1.88x). The kernels read a token's
  scale beside its vector and apply it to the scores (keys) and the probabilities
  (values), so the dequantization stays in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.models.config import ModelConfig
from shard.quantization.fp8 import FP8_DTYPE, dequantize_rows, quantize_rows

# bytes of one head vector's scale in an fp8 cache (float32)
SCALE_BYTES = 4


@dataclass(frozen=True)
class KVCacheLayer:
    """One layer's cache.

    Attributes:
        key: [num_blocks, block_size, num_kv_heads, head_dim], model dtype or
            float8_e4m3fn; token-major (contiguous) or a head-major view (see the module
            docstring).
        value: like ``key``, same layout.
        key_scale: [num_blocks, block_size, num_kv_heads] float32, contiguous: the scale
            of each key vector of an fp8 cache; None otherwise.
        value_scale: like ``key_scale``, for the values.
    """

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @classmethod
    def zeros(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        head_major: bool = False,
    ) -> KVCacheLayer:
        """A zero-filled layer, token-major or ``head_major`` (see the module docstring);
        with ``dtype`` float8_e4m3fn, with its (zero) scales.

        Raises:
            ValueError: an fp8 cache asked head-major.
        """
        if dtype == FP8_DTYPE:
            if head_major:
                raise ValueError("an fp8 KV cache is token-major only")
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            scales = (num_blocks, block_size, num_kv_heads)
            return cls(torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(scales, dtype=torch.float32, device=device),
                       torch.zeros(scales, dtype=torch.float32, device=device))

        def tensor() -> torch.Tensor:
            if head_major:
                storage = torch.zeros(
                    (num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device
                )
                return storage.permute(1, 2, 0, 3)
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(tensor(), tensor())

    @property
    def quantized(self) -> bool:
        """Whether keys and values are fp8 with scales (see the module docstring)."""
        return self.key_scale is not None

    def scales(self) -> KVCacheLayer | None:
        """An fp8 cache's scales as a layer of head_dim 1 (``key_scale[..., None]``, same
        for values), which every gather of this layer's blocks can read alike; None for
        an unquantized cache."""
        if self.key_scale is None or self.value_scale is None:
            return None
        return KVCacheLayer(self.key_scale[..., None], self.value_scale[..., None])

    def read_back(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` [num_tokens, num_kv_heads, head_dim] as this cache holds them once
        written: quantized and dequantized for an fp8 cache (in their dtype), as they are
        otherwise."""
        if not self.quantized:
            return k, v
        return (dequantize_rows(*quantize_rows(k), dtype=k.dtype),
                dequantize_rows(*quantize_rows(v), dtype=v.dtype))

    @property
    def block_size(self) -> int:
        return int(self.key.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.key.shape[0])

    @property
    def head_major(self) -> bool:
        """Whether each KV head's slots lie together (see the module docstring): token-major
        caches are contiguous, head-major ones are not (but with one KV head, where both
        layouts are the same memory order)."""
        return not self.key.is_contiguous()

    def heads_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value as [num_kv_heads, num_blocks * block_size, head_dim] views, by
        slot: contiguous when :attr:`head_major`, strided otherwise."""
        return self.slots(self.key).transpose(0, 1), self.slots(self.value).transpose(0, 1)

    @staticmethod
    def slots(cache: torch.Tensor) -> torch.Tensor:
        """``cache`` (``key`` or ``value``) as a [num_blocks * block_size, num_kv_heads,
        head_dim] view, by slot, in either layout (never a copy)."""
        return cache.view(-1, *cache.shape[2:])

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        has_skipped: bool,
    ) -> None:
        """Store new keys/values by slot.

        Args:
            k: [num_tokens, num_kv_heads, head_dim].
            v: [num_tokens, num_kv_heads, head_dim].
            slot_mapping: [num_tokens] int64; slot = block_id * block_size + offset.
                Entries < 0 are skipped (tokens whose K/V are already cached).
            has_skipped: whether ``slot_mapping`` has entries < 0
                (:attr:`AttentionMetadata.has_skipped_slots`, known on the host, so the
                tensor is never inspected).
        """
        key, value = self.slots(self.key), self.slots(self.value)
        if has_skipped:
            keep = slot_mapping >= 0
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        if self.key_scale is not None and self.value_scale is not None:
            (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
            self.key_scale.view(-1, k_scale.shape[1]).index_copy_(0, slot_mapping, k_scale)
            self.value_scale.view(-1, v_scale.shape[1]).index_copy_(0, slot_mapping, v_scale)
            # NOTE: as bytes: index_copy_ has no float8 kernel on CPU
            key, value = key.view(torch.uint8), value.view(torch.uint8)
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        key.index_copy_(0, slot_mapping, k.to(key.dtype))
        value.index_copy_(0, slot_mapping, v.to(value.dtype))


def bytes_per_block(
    model: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Bytes one KV block takes over all layers, K and V, on one rank, in the cache's
    ``dtype`` (float8_e4m3fn: with its scales)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    kv_heads = max(1, model.num_key_value_heads // tp_size)
    per_head = model.head_dim * elem + (SCALE_BYTES if dtype == FP8_DTYPE else 0)
    return 2 * model.num_hidden_layers * block_size * kv_heads * per_head


def allocate_kv_cache(
    model: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
    head_major: bool = False,
) -> list[KVCacheLayer]:
    """Allocate one :class:`KVCacheLayer` per layer, zero-filled, token-major or
    ``head_major`` (see the module docstring), in ``dtype`` (the model's, or
    float8_e4m3fn with scales).

    NOTE: zeros, not ``torch.empty``: padded block-table entries point at real blocks
    whose values are masked out, and ``0 * NaN`` from uninitialised memory would
    still poison the attention output.
    """
    kv_heads = max(1, model.num_key_value_heads // tp_size)
    return [
        KVCacheLayer.zeros(num_blocks, block_size, kv_heads, model.head_dim, dtype, device,
                           head_major)
        for _ in range(model.num_hidden_layers)
    ]
