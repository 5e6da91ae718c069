"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, TinyLlama).

The family's variations are read from :class:`ModelConfig`: q/k/v and o_proj biases
(Qwen2), per-head q/k RMSNorm before rotary (Qwen3, ``qk_norm``), an explicit
``head_dim`` that may differ from ``hidden_size / num_attention_heads``, tied embeddings.

Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj`` ...), except
that q/k/v and gate/up are fused; :attr:`LlamaForCausalLM.packed_modules` maps
checkpoint names onto the fused parameters with a shard id.

Forward works on flattened tokens (no padding): ``input_ids [num_tokens]``,
``positions [num_tokens]`` and an :class:`AttentionMetadata` describing the batch.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shard.attention.base import AttentionBackend
from shard.attention.layer import Attention
from shard.attention.metadata import AttentionMetadata
from shard.kernels.choices import current_kernels, gate_up_silu_rows
from shard.layers.activation import SiluAndMul
from shard.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shard.layers.norm import RMSNorm
from shard.layers.rotary import RotaryEmbedding
from shard.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from shard.models.config import ModelConfig

# (cos, sin) of the tokens' rotary angles, each [num_tokens, 1, head_dim]
Rope = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention with GQA, rotary embeddings and a paged KV cache.

    With ``config.qk_norm`` every query and key head vector is RMS-normalised (one
    weight of size head_dim per projection, shared by the heads) before rotary, as in
    Qwen3 (Qwen team 2025, "Qwen3 Technical Report", arXiv:2505.09388, §2). The norms
    act per head, so every tensor-parallel rank holds them whole.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        # This rank's heads (KV heads may be replicated when fewer than ranks).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            backend, self.num_heads, self.num_kv_heads, self.head_dim, config.head_dim**-0.5
        )

    def forward(
        self, rope: Rope, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """rope: (cos, sin) of the tokens' positions (see :class:`RotaryEmbedding`);
        hidden: [num_tokens, hidden_size] → [num_tokens, hidden_size]."""
        qkv = self.qkv_proj(hidden)
        # q/k norms, rotary, the KV cache write, attention: [num_tokens, num_heads, head_dim]
        out = self.attn.forward_qkv(qkv, *rope, metadata, self.q_norm, self.k_norm)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with gate/up fused.

    On CUDA, at decode batches of 1 to 128 tokens, the gate/up product
    and the activation run as one Triton kernel (:mod:`shard.kernels.gate_up_silu`,
    where the model's kernel choices have it); elsewhere as the projection then
    :class:`SiluAndMul`.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )
        self.act_fn = SiluAndMul(fp8_output=self.down_proj.takes_fp8_activations)
        self.kernels = current_kernels()

    def _fused_kernel(self) -> Any | None:
        """The fused gate/up + SwiGLU kernel's function where it can run for this layer
        (an unquantized CUDA weight without a bias or a packed CPU copy, the kernel in the
        model's choices and not disabled), else None."""
        gate_up = self.gate_up_proj
        if not gate_up.weight.is_cuda or gate_up.bias is not None \
                or gate_up.packed_weight is not None or gate_up.weight_scale is not None:
            return None
        return self.kernels.gate_up_silu

    def fused_decode_rows(self) -> range:
        """Row counts whose gate/up product and activation run as the fused kernel (its
        ``MIN_ROWS``..``MAX_ROWS`` where :meth:`_fused_kernel` runs and it takes the
        weight's dtype; empty elsewhere): the warm-up does not tune the gate/up product at
        these sizes."""
        if self._fused_kernel() is None:
            return range(0)
        return gate_up_silu_rows(self.gate_up_proj.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._fused_kernel()
        if kernel is not None:
            act: torch.Tensor | None = kernel(x, self.gate_up_proj.weight,
                                              pdl=self.kernels.pdl)
            if act is not None:  # None: rows or dtypes the kernel does not take
                return self.down_proj(act)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def fused_decode_rows(model: Any) -> dict[int, range]:
    """Per gate/up weight of ``model`` (anything with ``modules()``), by its
    ``data_ptr()``, the row counts whose gate/up product never runs, the fused kernel
    taking them (:meth:`LlamaMLP.fused_decode_rows`; weights where it does not run are
    left out): :func:`shard.kernels.gemm_tuning.tune`'s ``decode_elsewhere``."""
    return {m.gate_up_proj.weight.data_ptr(): rows
            for m in model.modules() if isinstance(m, LlamaMLP)
            if (rows := m.fused_decode_rows())}


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend)
        self.mlp = LlamaMLP(config)
        # with fp8 weights the norms hand the products their rows quantized
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                       self.self_attn.qkv_proj.takes_fp8_activations)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                self.mlp.gate_up_proj.takes_fp8_activations)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's output, residual: the residual stream before it
        (None in the first layer) → (this layer's output, residual stream), each
        [num_tokens, hidden_size]. The residual adds are fused into the norms."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, backend) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)  # once for all layers
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, metadata)
        if residual is None:  # a model without layers
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama causal LM (a :class:`~shard.models.base.CausalLM`).

    Args:
        config: parsed model config.
        backend: attention backend shared by all layers.

    Built inside :func:`~shard.distributed.parallel_context`, the parallel layers shard
    themselves for that rank; this code never sees one.
    """

    # checkpoint module name → (fused module name, shard id)
    packed_modules: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that are not parameters here (buffers some exporters save)
    ignored_suffixes: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 → hidden [num_tokens, hidden_size]
        (model dtype)."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """hidden [n, hidden_size] → logits [n, vocab_size] in ``dtype`` (None: the
        model's dtype, uncast)."""
        return self.lm_head(hidden, dtype)

    def fused_decode_rows(self) -> dict[int, range]:
        """The gate/up weights' decode row counts taken by the fused gate/up + SwiGLU
        kernel (:func:`fused_decode_rows`)."""
        return fused_decode_rows(self)

    def attention_layers(self) -> list[Attention]:
        """The per-layer :class:`Attention` modules, in layer order (to bind the KV cache)."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def map_checkpoint_name(self, name: str) -> tuple[str, str | int | None] | None:
        """Checkpoint tensor name → (parameter name, shard id or None), or None to skip."""
        if name.endswith(self.ignored_suffixes):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        for ckpt, (packed, shard_id) in self.packed_modules.items():
            token = f".{ckpt}."
            if token in name:
                return name.replace(token, f".{packed}."), shard_id
        return name, None
