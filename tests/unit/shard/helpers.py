"""Helpers for shard tests: tiny Hugging Face models, a toy block allocator, and
transformers references."""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from shard.config import ShardConfig
from shard.model_runner import ModelRunner
from shard.records import CachedRequest, DecodeStep, Generation, NewRequest, PrefillStep
from shard.sampling_types import SamplingParams

# NOTE: the shard tests run on CPU; SHARD_TEST_DEVICE=cuda runs the model tests on a GPU
# (used by hand on the GPU machine; CI is CPU-only).
DEVICE = os.environ.get("SHARD_TEST_DEVICE", "cpu")
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="checks CPU KV sizing")
BLOCK_SIZE = 4
VOCAB = 256
BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, tuple[type[PreTrainedModel], Any]] = {
    "llama": (LlamaForCausalLM, LlamaConfig(**BASE, tie_word_embeddings=False)),
    "llama_tied": (
        LlamaForCausalLM,
        LlamaConfig(**{**BASE, "vocab_size": 128}, tie_word_embeddings=True),
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**BASE, tie_word_embeddings=False)),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(**BASE, tie_word_embeddings=False, sliding_window=None),
    ),
    # head_dim 32 != hidden_size / num_attention_heads (16): q/k/v are 128 wide, o_proj 128→64
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(**{**BASE, "head_dim": 32}, tie_word_embeddings=False),
    ),
    "qwen3_tied": (
        Qwen3ForCausalLM,
        Qwen3Config(**{**BASE, "vocab_size": 128}, tie_word_embeddings=True),
    ),
    "llama3_rope": (LlamaForCausalLM, LlamaConfig(**BASE, rope_parameters=LLAMA3_ROPE)),
    "linear_rope": (
        LlamaForCausalLM,
        LlamaConfig(
            **BASE, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
        ),
    ),
}

# prompts of 1, 5, 17 and 40 tokens (fixed, so expected tokens are stable)
_rng = random.Random(1234)
PROMPTS: list[list[int]] = [[_rng.randrange(3, 128) for _ in range(n)] for n in (1, 5, 17, 40)]


def make_hf_model(variant: str, folder: Path) -> PreTrainedModel:
    """Create a seeded random fp32 model of ``variant`` and save it (safetensors)."""
    cls, config = VARIANTS[variant]
    torch.manual_seed(0)
    model = cls(config).to(torch.float32).eval()
    if variant == "qwen2":
        # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    if variant.startswith("qwen3"):
        # HF initialises the q/k norm weights to one; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    return model


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers greedy continuation (EOS disabled)."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def hf_logits(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 logits from transformers."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()


def make_runner(
    folder: Path, kv_cache_bytes: int = 2 * 1024 * 1024, warmup: bool = True
) -> ModelRunner:
    if DEVICE != "cpu":
        # the runners of earlier tests are garbage (a runner and its parts refer to each
        # other): their GPU memory goes back before this one sizes its KV cache from what
        # is free
        gc.collect()
        torch.cuda.empty_cache()
    runner = ModelRunner(
        ShardConfig(
            model_path=str(folder),
            device=DEVICE,
            dtype="float32",
            block_size=BLOCK_SIZE,
            kv_cache_bytes=kv_cache_bytes,
            gpu_memory_fraction=0.3,
        )
    )
    if warmup:
        runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    return runner


@dataclass
class BlockPool:
    """A toy router-side allocator handing out blocks in a shuffled order, so block
    tables are non-contiguous and permuted."""

    num_blocks: int
    seed: int = 0
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(min(self.num_blocks, 4096)))  # GPU caches are huge
        random.Random(self.seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "pool exhausted"
        out, self.free = self.free[:n], self.free[n:]
        return out

    def for_tokens(self, num_tokens: int) -> list[int]:
        return self.take(-(-num_tokens // BLOCK_SIZE))


def request(
    rid: int,
    ids: list[int],
    blocks: list[int],
    cache_len: int = 0,
    sampling: SamplingParams | None = None,
    **kw: Any,
) -> NewRequest:
    """A new request; ``num_tokens=n`` makes its first step a chunk of n tokens."""
    return NewRequest(rid, tuple(ids), cache_len, tuple(blocks), sampling or SamplingParams(), **kw)


def prefill(
    runner: ModelRunner, *requests: NewRequest, cached: tuple[CachedRequest, ...] = (),
    finished: tuple[int, ...] = (),
) -> dict[int, int]:
    """Prefill and return {request_id: first token} of the requests it completes."""
    out = runner.prefill(PrefillStep(requests, cached, finished))
    return {g.request_id: g.token_id for g in out.generations}


class DecodeDriver:
    """Decodes every row, appending a block whenever a request crosses a block boundary
    (as the router does) and collecting tokens per request."""

    def __init__(self, runner: ModelRunner, pool: BlockPool) -> None:
        self.runner = runner
        self.pool = pool

    def step(self, finished: tuple[int, ...] = ()) -> dict[int, int]:
        return {g.request_id: g.token_id for g in self.step_output(finished)}

    def step_output(self, finished: tuple[int, ...] = ()) -> tuple[Generation, ...]:
        appends = []
        for r in self.runner.requests.decoding:
            if r.request_id not in finished and r.seq_len + 1 > len(r.block_table) * BLOCK_SIZE:
                appends.append(CachedRequest(r.request_id, tuple(self.pool.take(1))))
        return self.runner.decode(DecodeStep(tuple(appends), finished)).generations
