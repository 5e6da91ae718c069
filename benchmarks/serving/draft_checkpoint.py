"""A draft model for speculative decoding cut from a served model: its first N decoder
layers with its embeddings, final norm and LM head (the same tokenizer and vocabulary),
written as a Hugging Face folder that ``--speculative-model`` takes.

Run from the repository root::

    python -m benchmarks.serving.draft_checkpoint --layers 4 --out /tmp/draft-4
    shardserve launch --speculative-model /tmp/draft-4

Without ``--model`` it cuts the default model (SmolLM2-135M-Instruct: 30 layers).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json")


def cut_layers(source: Path, out: Path, layers: int) -> int:
    """Write ``source``'s first ``layers`` decoder layers (and everything that is not a
    layer) into ``out``; returns the draft's parameter count.

    Raises:
        ValueError: ``layers`` is not in [1, the model's layers).
    """
    config = json.loads((source / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= layers < total:
        raise ValueError(f"--layers must be in [1, {total}) for {source}")
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers},
                                                indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return sum(t.numel() for t in tensors.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None,
                   help="the served model's folder (default: the default model)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers the draft keeps")
    p.add_argument("--out", type=Path, required=True, help="folder to write the draft into")
    args = p.parse_args()
    source = args.model
    if source is None:
        from router.model_files import prepare_default_model

        source = prepare_default_model().path
    params = cut_layers(source, args.out, args.layers)
    print(f"wrote {args.out}: {args.layers} layers of {source.name}, {params / 1e6:.1f}M "
          "parameters")


if __name__ == "__main__":
    main()
