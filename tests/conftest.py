"""Fixtures shared by every test folder."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _quiet_triton_teardown() -> None:
    """Send the interpreter's last stderr lines to /dev/null when triton was loaded.

    After the session, libtriton's nanobind layer reports every object of it still alive
    when the interpreter ends (``nanobind: leaked 64 types!`` and ~25 more lines) and
    triton exposes no switch for it; the shard process leaves by ``os._exit`` for the
    same reason (shard/server.py), and triton's compile workers silence it the same way
    (triton/_compile_warmup_pool.py). Registered when pytest loads this file, before the
    tests import Ray, multiprocessing or loguru, it runs after their exit handlers
    (atexit runs them last-in, first-out), whose output still shows.
    """
    if "triton._C.libtriton" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


atexit.register(_quiet_triton_teardown)


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton reads TRITON_INTERPRET when ``triton.jit`` decorates a kernel, so it must be set
# before any test module (in any folder) imports our kernels: here, in the root conftest.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted into a Hugging Face folder (cached across runs)."""
    from router.model_files import prepare_default_model

    return prepare_default_model().path


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):  # type: ignore[no-untyped-def]
    """The default model's tokenizer, as the router loads it."""
    from router.tokenizer import Tokenizer

    return Tokenizer.from_folder(default_model_dir)


def save_tiny_llama(
    folder: Path, tokenizer_dir: Path, max_position_embeddings: int = 512,
    num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 128,
) -> Path:
    """Save a random fp32 Llama (2 layers, 16-dim heads) with ``tokenizer_dir``'s
    tokenizer files into ``folder``; return ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=16 * num_attention_heads, intermediate_size=intermediate_size,
        num_hidden_layers=2, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        # Large weights make attention sharp, so outputs depend on which K/V are read.
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random fp32 Llama (GQA 4/2 heads, 2 layers, 512-token context) with the default
    model's tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_long_model_dir(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny Llama with a 4096-token context (long prompts, default budgets)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), default_model_dir,
                           max_position_embeddings=4096)
