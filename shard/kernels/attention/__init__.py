"""Our Triton kernels for paged attention (import only where ``triton`` is installed).

- :mod:`.cache_write`: write new K/V into the paged cache by slot mapping.
- :mod:`.decode`: split-KV ("flash-decoding") decode over the paged cache.
- :mod:`.prefill`: variable-length causal prefill over a paged prefix plus new tokens.
- :mod:`.rope_write`: q/k norms, rotary and the cache write fused, from the QKV output.

All kernels read the cache layout ``[num_blocks, block_size, num_kv_heads, head_dim]``
(PagedAttention, Kwon et al. 2023) and run on CUDA, or on CPU tensors under
``TRITON_INTERPRET=1`` (tests).
"""

from shard.kernels.attention.cache_write import write_kv_cache
from shard.kernels.attention.decode import DecodeConfig, decode_attention, split_classes
from shard.kernels.attention.prefill import PrefillConfig, prefill_attention
from shard.kernels.attention.rope_write import rope_write

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "decode_attention",
    "prefill_attention",
    "rope_write",
    "split_classes",
    "write_kv_cache",
]
