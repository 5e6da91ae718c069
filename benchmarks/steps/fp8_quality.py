"""What fp8 weights and an fp8 KV cache cost in quality, on the default model.

Runs the model runner (no server) on the CPU with SmolLM2-135M-Instruct in five
configurations: float32 (the reference), bfloat16, bfloat16 with fp8 weights
(``--quantization fp8``), with an fp8 KV cache (``--kv-cache-dtype fp8``), and with both.
For each:

- perplexity of a fixed text (the first ``--text-tokens`` tokens of the ``specialnames``
  topic of Python's own documentation, ``pydoc_data.topics``), computed in chunks of
  ``--chunk`` tokens, each attending over the earlier ones from the KV cache (so an fp8
  cache is read as it is in serving);
- greedy agreement with the float32 reference over ``--prompts`` prompts (the first
  ``--prompt-tokens`` tokens of as many other topics, in sorted order) x ``--new-tokens``
  tokens, decoded as one batch: the share of positions with the reference's token, and
  the mean number of tokens before the first difference;
- the KV cache's bytes per token.

Prints a markdown table (device, versions, date) and writes it to ``--out``.

    python -m benchmarks.steps.fp8_quality --out benchmarks/results/fp8-quality-cpu.md
"""

from __future__ import annotations

import argparse
import math
import pydoc_data.topics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.harness import header
from router.model_files import prepare_default_model
from router.tokenizer import Tokenizer
from shard.config import ShardConfig
from shard.inputs import SeqChunk
from shard.kv_cache import bytes_per_block
from shard.model_runner import ModelRunner
from shard.records import DecodeStep, NewRequest, PrefillStep
from shard.sampling_types import SamplingParams

BLOCK_SIZE = 16
TEXT_TOPIC = "specialnames"


@dataclass(frozen=True)
class Setup:
    """One configuration: its name and the shard flags that make it."""

    name: str
    dtype: str
    quantization: str = "none"
    kv_cache_dtype: str = "auto"


SETUPS = (
    Setup("float32 (reference)", "float32"),
    Setup("bfloat16", "bfloat16"),
    Setup("bf16 + fp8 weights", "bfloat16", quantization="fp8"),
    Setup("bf16 + fp8 KV cache", "bfloat16", kv_cache_dtype="fp8"),
    Setup("bf16 + fp8 weights + fp8 KV", "bfloat16", "fp8", "fp8"),
)


@dataclass(frozen=True)
class Result:
    perplexity: float
    tokens: list[list[int]]  # greedy continuation of each prompt
    kv_bytes_per_token: int
    seconds: float


def texts(tokenizer: Tokenizer, text_tokens: int, prompts: int,
          prompt_tokens: int) -> tuple[list[int], list[list[int]]]:
    """(the perplexity text's tokens, the prompts' tokens), both fixed by this Python."""
    topics = pydoc_data.topics.topics
    text = tokenizer.encode(topics[TEXT_TOPIC], add_special_tokens=False)[:text_tokens]
    assert len(text) == text_tokens, f"the {TEXT_TOPIC} topic has only {len(text)} tokens"
    others = [topics[name] for name in sorted(topics) if name != TEXT_TOPIC]
    encoded = [tokenizer.encode(t, add_special_tokens=False) for t in others]
    chosen = [ids[:prompt_tokens] for ids in encoded if len(ids) >= prompt_tokens]
    assert len(chosen) >= prompts, f"only {len(chosen)} topics of {prompt_tokens} tokens"
    return text, chosen[:prompts]


def make_runner(model: Path, setup: Setup, max_prefill: int, max_total: int) -> ModelRunner:
    runner = ModelRunner(ShardConfig(
        model_path=str(model), device="cpu", dtype=setup.dtype, block_size=BLOCK_SIZE,
        kv_cache_bytes=1 << 30, quantization=setup.quantization,
        kv_cache_dtype=setup.kv_cache_dtype))
    runner.warmup(max_batch_prefill_tokens=max_prefill, max_total_tokens=max_total)
    return runner


@torch.inference_mode()
def perplexity(runner: ModelRunner, text: list[int], chunk: int) -> float:
    """exp(mean next-token NLL) over ``text``, prefilled ``chunk`` tokens at a time."""
    blocks = list(range(-(-len(text) // BLOCK_SIZE)))
    nll, count = 0.0, 0
    for start in range(0, len(text), chunk):
        piece = text[start:start + chunk]
        _, hidden = runner.run_chunks([SeqChunk(piece, start, blocks)], is_prefill=True)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
        targets = text[start + 1:start + len(piece) + 1]
        picked = logprobs[torch.arange(len(targets)), torch.tensor(targets)]
        nll -= float(picked.sum())
        count += len(targets)
    runner.reset()
    return math.exp(nll / count)


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` decoded as one batch, ``new_tokens`` each."""
    per_request = -(-(len(prompts[0]) + new_tokens) // BLOCK_SIZE)
    requests = tuple(
        NewRequest(i, tuple(p), 0, tuple(range(i * per_request, (i + 1) * per_request)),
                   SamplingParams())
        for i, p in enumerate(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    for generation in runner.prefill(PrefillStep(requests)).generations:
        out[generation.request_id].append(generation.token_id)
    for _ in range(new_tokens - 1):
        for generation in runner.decode(DecodeStep()).generations:
            out[generation.request_id].append(generation.token_id)
    runner.reset()
    return out


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of positions equal to the reference's, mean tokens before the first
    difference)."""
    same = sum(a == b for got, want in zip(tokens, reference, strict=True)
               for a, b in zip(got, want, strict=True))
    prefixes = []
    for got, want in zip(tokens, reference, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b),
                 len(want))
        prefixes.append(n)
    return same / sum(len(r) for r in reference), sum(prefixes) / len(prefixes)


def run(setup: Setup, model: Path, text: list[int], prompts: list[list[int]],
        args: argparse.Namespace) -> Result:
    started = time.perf_counter()
    max_prefill = max(args.chunk, len(prompts) * len(prompts[0]))
    runner = make_runner(model, setup, max_prefill, len(text) + BLOCK_SIZE)
    ppl = perplexity(runner, text, args.chunk)
    tokens = greedy(runner, prompts, args.new_tokens)
    kv_dtype = runner.kv_cache[0].key.dtype
    per_token = bytes_per_block(runner.model_config, BLOCK_SIZE, kv_dtype) // BLOCK_SIZE
    return Result(ppl, tokens, per_token, time.perf_counter() - started)


def table(results: dict[str, Result], args: argparse.Namespace) -> str:
    reference = results[SETUPS[0].name]
    bf16 = results[SETUPS[1].name]
    lines = [
        header("fp8 quality, SmolLM2-135M-Instruct", "cpu", "torch", "triton"),
        "",
        f"perplexity: {args.text_tokens} tokens of pydoc topic `{TEXT_TOPIC}`, chunks of "
        f"{args.chunk}; greedy: {args.prompts} prompts x {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new tokens each, one batch",
        "",
        "| configuration | perplexity | vs bf16 | greedy = fp32 | tokens before 1st diff "
        "| greedy = bf16 | KV bytes/token | run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        same, prefix = agreement(r.tokens, reference.tokens)
        same_bf16, _ = agreement(r.tokens, bf16.tokens)
        change = 100 * (r.perplexity / bf16.perplexity - 1)
        lines.append(f"| {name} | {r.perplexity:.4f} | {change:+.2f}% | {100 * same:.1f}% "
                     f"| {prefix:.1f} | {100 * same_bf16:.1f}% | {r.kv_bytes_per_token} "
                     f"| {r.seconds:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = prepare_default_model().path
    text, prompts = texts(Tokenizer.from_folder(model), args.text_tokens, args.prompts,
                          args.prompt_tokens)
    results = {setup.name: run(setup, model, text, prompts, args) for setup in SETUPS}
    report = table(results, args)
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
