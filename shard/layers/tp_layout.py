"""How a model's heads and features split over tensor-parallel ranks (pure Python, no
torch, so the launcher can check ``--num-shard`` before starting any shard).

Layout (Megatron-LM: Shoeybi et al. 2019, §3): query heads and MLP intermediate
features are split evenly; KV heads are split evenly when there are at least as many as
ranks, and otherwise each KV head is replicated on ``tp_size / num_kv_heads``
consecutive ranks (the ranks whose query heads attend to it, as in vLLM).
"""

from __future__ import annotations

import json
from pathlib import Path


def tp_size_problem(
    num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int
) -> str | None:
    """Why ``tp_size`` cannot split this model, or None when it can."""
    if tp_size < 1:
        return f"tp_size must be >= 1, got {tp_size}"
    if num_heads % tp_size:
        return f"num_attention_heads={num_heads} is not divisible by {tp_size}"
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return (
            f"num_key_value_heads={num_kv_heads} neither divides into {tp_size} ranks "
            f"nor replicates evenly over them"
        )
    if intermediate_size % tp_size:
        return f"intermediate_size={intermediate_size} is not divisible by {tp_size}"
    return None


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every shard count that splits the model, ascending (always includes 1)."""
    return [
        n
        for n in range(1, num_heads + 1)
        if tp_size_problem(num_heads, num_kv_heads, intermediate_size, n) is None
    ]


def check_tp_size(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """Raise unless ``tp_size`` ranks can split the model.

    Raises:
        ValueError: naming the reason and the valid shard counts, e.g. ``"cannot split
            the model over 2 shards: num_attention_heads=9 is not divisible by 2; valid
            --num-shard values: 1, 3, 9"``.
    """
    problem = tp_size_problem(num_heads, num_kv_heads, intermediate_size, tp_size)
    if problem is not None:
        valid = ", ".join(map(str, valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)))
        raise ValueError(
            f"cannot split the model over {tp_size} shards: {problem}; "
            f"valid --num-shard values: {valid}"
        )


def check_tp_size_for_folder(model_path: str | Path, tp_size: int) -> None:
    """:func:`check_tp_size` on a Hugging Face ``config.json`` (no torch needed).

    Raises:
        ValueError: as :func:`check_tp_size`.
        FileNotFoundError: no config.json in ``model_path``.
    """
    with open(Path(model_path) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    check_tp_size(heads, kv_heads, int(cfg["intermediate_size"]), tp_size)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: ``num_kv_heads / tp_size``, at least 1 (replicated)."""
    return max(1, num_kv_heads // tp_size)


def first_kv_head(num_kv_heads: int, tp_rank: int, tp_size: int) -> int:
    """Index of the first KV head that rank ``tp_rank`` holds.

    With replication (``num_kv_heads < tp_size``) rank r holds head
    ``r * num_kv_heads // tp_size``, so the ranks holding query heads
    ``[r * h/t, (r+1) * h/t)`` hold the KV head those query heads use.
    """
    if num_kv_heads >= tp_size:
        return tp_rank * (num_kv_heads // tp_size)
    return tp_rank * num_kv_heads // tp_size


def vocab_per_rank(vocab_size: int, tp_size: int) -> int:
    """Embedding / LM-head rows per rank: ``ceil(vocab_size / tp_size)``; the last
    rank's rows past ``vocab_size`` are zero padding."""
    return -(-vocab_size // tp_size)
