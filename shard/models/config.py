"""Parse a Hugging Face ``config.json`` into a frozen :class:`ModelConfig`.

Both spellings of the rotary settings are accepted: transformers 5.x writes
``rope_parameters: {rope_theta, rope_type, ...}``; 4.x writes ``rope_theta`` plus an
optional ``rope_scaling: {rope_type | type, factor, ...}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")
# Architectures that RMS-normalise each query and key head before rotary (Qwen3).
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings.

    Attributes:
        rope_type: ``"default"``, ``"linear"`` or ``"llama3"``.
        theta: Base of the inverse frequencies (``rope_theta``).
        factor: Scaling factor (linear, llama3); 1.0 for default.
        low_freq_factor: Llama 3 only.
        high_freq_factor: Llama 3 only.
        original_max_position_embeddings: Llama 3 only: pretraining context, in tokens.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the shard needs (Hugging Face names).

    Attributes:
        architecture: e.g. ``"LlamaForCausalLM"``.
        hidden_size, intermediate_size, num_hidden_layers: model width/depth.
        num_attention_heads, num_key_value_heads, head_dim: attention geometry
            (head_dim defaults to hidden_size // num_attention_heads).
        rms_norm_eps: RMSNorm epsilon.
        vocab_size: rows of the embedding / LM head.
        max_position_embeddings: longest supported sequence, in tokens.
        tie_word_embeddings: LM head shares the embedding weight.
        attention_bias: q/k/v (and o, for Llama) projections carry a bias.
        o_proj_bias: o_proj carries a bias (Llama: = attention_bias; Qwen2: False).
        mlp_bias: gate/up/down projections carry a bias.
        qk_norm: each query and key head vector goes through an RMSNorm of size
            head_dim (weights ``self_attn.q_norm`` / ``self_attn.k_norm``, shared by all
            heads) before rotary, as in Qwen3.
        rope: rotary settings.
        bos_token_id, eos_token_ids: special tokens (eos may be several).
        torch_dtype: checkpoint dtype string, e.g. ``"bfloat16"`` (informational).
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = RopeConfig()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``.

        Raises:
            FileNotFoundError: when the file is missing.
            ValueError: on an unsupported rope type, inconsistent head counts or
                sliding-window attention.
        """
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json`` dict (see :meth:`from_pretrained`)."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = str(archs[0])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        hidden = int(cfg["hidden_size"])
        if heads % kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        sliding = sliding_window_layers(cfg)
        if sliding:
            raise ValueError(
                f"layers {sliding} use sliding-window attention (use_sliding_window / "
                "layer_types), which is not supported"
            )
        # NOTE: Qwen2 has q/k/v bias but no o_proj bias and no attention_bias key.
        is_qwen2 = arch.startswith("Qwen2")
        attention_bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),))
        )
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            rope=parse_rope(cfg),
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=eos_ids,
            torch_dtype=None if dtype is None else str(dtype),
        )


def sliding_window_layers(cfg: dict[str, Any]) -> list[int]:
    """Indices of the layers Hugging Face runs with sliding-window attention, in the
    Qwen2/Qwen3 spelling: ``layer_types`` entries ``"sliding_attention"`` or, in configs
    without ``layer_types``, layers from ``max_window_layers`` on when
    ``use_sliding_window`` is true. Empty for configs with neither key.
    """
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
        return []
    num_layers = int(cfg["num_hidden_layers"])
    return list(range(int(cfg.get("max_window_layers", num_layers)), num_layers))


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Rotary settings from either config spelling (5.x ``rope_parameters`` or 4.x
    ``rope_theta`` + ``rope_scaling``).

    Raises:
        ValueError: on a rope type other than :data:`ROPE_TYPES`.
    """
    params: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    scaling: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    original = merged.get(
        "original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)
    )
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )
