"""A random checkpoint for the serving benchmarks: a Hugging Face folder (config.json,
safetensors, tokenizer files) of a Qwen3 or Llama model of given dimensions, written by
``transformers`` with seeded random weights, and the weight bytes a decode step reads."""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
from pathlib import Path
from typing import Any

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}  # --arch values
LLAMA3_8B_DIMS = dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                      intermediate=14336, vocab=49152, max_position=4096)
TINY_DIMS = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                 vocab=49152, max_position=4096)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt")
# --flag name -> config.json key
CONFIG_KEYS = dict(hidden="hidden_size", layers="num_hidden_layers", heads="num_attention_heads",
                   kv_heads="num_key_value_heads", head_dim="head_dim",
                   intermediate="intermediate_size", vocab="vocab_size",
                   max_position="max_position_embeddings")


def write_checkpoint(args: argparse.Namespace, folder: Path) -> None:
    """Save a random model of ``args``' architecture and dimensions (weights drawn on
    ``args.device`` with seed ``args.seed``) into ``folder``, with the tokenizer files.

    Raises:
        ValueError: the tokenizer has fewer ids than ``--vocab`` (prompts would be invalid).
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    ids = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True)
    if ids < args.vocab:
        raise ValueError(f"--vocab {args.vocab} exceeds the tokenizer's {ids} ids "
                         f"({args.tokenizer})")
    special: dict[str, Any] = {}
    source_config = args.tokenizer / "config.json"
    if source_config.exists():
        src = json.loads(source_config.read_text())
        special = {k: src[k] for k in ("bos_token_id", "eos_token_id") if k in src}
    config_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[args.arch]
    dims = {key: getattr(args, name) for name, key in CONFIG_KEYS.items()}
    config = config_cls(**dims, tie_word_embeddings=False, **special)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    del model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    for name in TOKENIZER_FILES:
        if (args.tokenizer / name).exists():
            shutil.copy(args.tokenizer / name, folder / name)


def check_checkpoint(args: argparse.Namespace, folder: Path) -> None:
    """Check that the checkpoint in ``folder`` has ``args``' architecture and dimensions.

    Raises:
        ValueError: naming the first field that differs.
    """
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != [ARCHITECTURES[args.arch]]:
        raise ValueError(f"{folder}: architectures {config.get('architectures')}, "
                         f"--arch {args.arch} wants {ARCHITECTURES[args.arch]}")
    for name, key in CONFIG_KEYS.items():
        if config.get(key) != getattr(args, name):
            raise ValueError(f"{folder}: {key} {config.get(key)} != --{name.replace('_', '-')} "
                             f"{getattr(args, name)}")


def weight_bytes(folder: Path) -> int:
    """Bytes of weights one decode step reads, from the safetensors headers of ``folder``:
    every tensor, the embedding table left out when the LM head has its own weight (a
    step reads only the rows of its tokens)."""
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as st:
            for key in st.keys():
                tensor_slice = st.get_slice(key)
                sizes[key] = math.prod(tensor_slice.get_shape()) * _ITEMSIZE[
                    tensor_slice.get_dtype()]
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values())


_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
