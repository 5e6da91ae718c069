"""What the router and the converter agree on about the default model: its id and how
a finished conversion is recognised. Plain Python (no torch, no transformers), so the
router can check for the converted folder without loading the converter
(:mod:`shard.convert`, which it runs as a child process).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Written last into a converted folder: its presence means the conversion finished.
CONVERTED_MARKER = "shardserve-converted.json"


def is_converted(dest: Path) -> bool:
    """Whether ``dest`` holds a finished conversion."""
    return (dest / CONVERTED_MARKER).exists() and (dest / "config.json").exists()
