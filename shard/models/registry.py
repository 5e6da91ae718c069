"""Model registry: Hugging Face architecture name → the class implementing it (a
:class:`~shard.models.base.CausalLM`). Adding a family is one new module plus one line
here."""

from __future__ import annotations

from shard.models.base import ModelClass
from shard.models.config import ModelConfig
from shard.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,  # q/k norm from ModelConfig.qk_norm
}


def get_model_class(config: ModelConfig) -> ModelClass:
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
