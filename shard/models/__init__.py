"""Model registry: Hugging Face architecture name → model class."""

from __future__ import annotations

from shard.models.config import ModelConfig
from shard.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norm from ModelConfig.qk_norm
}

__all__ = ["MODEL_REGISTRY", "ModelConfig", "get_model_class"]


def get_model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class implementing ``config.architecture``.

    Raises:
        ValueError: on an unsupported architecture, listing the supported ones.
    """
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {supported}"
        ) from None
