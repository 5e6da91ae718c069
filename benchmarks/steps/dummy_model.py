"""The dummy-weight model and the prefilled requests that the benchmarks driving a
:class:`~shard.model_runner.ModelRunner` directly share (decode_profile, shard_step,
tp_decode): config.json contents of the Llama-3-8B-shaped model of the GPU benchmark, its
Qwen3 variant and a small one for CPU checks, and requests prefilled with blocks handed
out as the router would (consecutive ids, simplified).
"""

from __future__ import annotations

import random

from shard.model_runner import ModelRunner
from shard.records import NewRequest, PrefillStep
from shard.sampling_types import SamplingParams

# config.json of Llama-3-8B dimensions with the default model's vocabulary (49152)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=49152, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
)
QWEN3_8B_SHAPE = {**LLAMA3_8B, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                  "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                  "attention_bias": False}
SMALL = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024}
BLOCK = 16  # tokens per KV block


class Blocks:
    """Consecutive block ids of ``size`` tokens handed out in order (the router's job,
    simplified)."""

    def __init__(self, size: int = BLOCK) -> None:
        self.size, self.next = size, 0

    def take(self, tokens: int) -> tuple[int, ...]:
        """Ids of the blocks that hold ``tokens`` more tokens."""
        n = -(-tokens // self.size)
        self.next += n
        return tuple(range(self.next - n, self.next))


def prefill_requests(runner: ModelRunner, batch: int, prompt_len: int, steps: int,
                     per: int = 0, spare: int = 8) -> list[int]:
    """Prefill ``batch`` greedy requests of ``prompt_len`` random tokens (``random.Random(0)``)
    with blocks for ``steps`` + ``spare`` more tokens, ``per`` prompts per Prefill (default:
    ~8192 tokens each); returns their request ids, in row order (every later decode step
    steps them all)."""
    rng = random.Random(0)
    blocks = Blocks(runner.block_size)
    vocab = runner.model_config.vocab_size
    reqs = [NewRequest(i, tuple(rng.randrange(3, vocab) for _ in range(prompt_len)), 0,
                       blocks.take(prompt_len + steps + spare), SamplingParams())
            for i in range(batch)]
    per = per or max(1, 8192 // prompt_len)
    for start in range(0, batch, per):
        runner.prefill(PrefillStep(tuple(reqs[start:start + per])))
    return [r.request_id for r in reqs]
