"""M7: the same greedy tokens and logits at TP=2 (gloo, CPU) as at TP=1 — for a tiny
fp32 random Llama over several prompts and batch compositions, with KV heads split
(TP=2) and replicated (TP=4 over 2 KV heads), and for the default model at TP=3.

Logits are compared by ``max|a - b| / max|a| <= 1e-4``: the all-reduce only changes
the summation order of fp32 partial sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.shard.helpers import PROMPTS, make_hf_model
from tests.unit.shard.tp_harness import run_tp

REL_TOL = 1e-4


def _assert_same(reference: dict[str, Any], other: dict[str, Any]) -> None:
    ref, got = reference["logits"], other["logits"]
    assert ref.shape == got.shape
    rel = float((ref - got).abs().max() / ref.abs().max())
    assert rel <= REL_TOL, f"logits differ by {rel:.2e} relative"
    for key in ("alone", "together", "joined"):
        assert other[key] == reference[key], key
    # the compositions agree with each other too (M6), so the check has teeth
    assert reference["alone"] == reference["together"] == reference["joined"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tp-tiny")
    make_hf_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def tiny_tp1(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_tp(tiny, 1, PROMPTS, 12, tmp_path_factory.mktemp("tp1"))


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_llama_tp_matches_tp1(
    tiny: Path, tiny_tp1: dict[str, Any], world_size: int, tmp_path: Path
) -> None:
    _assert_same(tiny_tp1, run_tp(tiny, world_size, PROMPTS, 12, tmp_path))


def test_grammar_constrained_tokens_agree_across_ranks_and_with_tp1(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every rank masks with its own matchers; all ranks (and TP=1) pick the same
    tokens, greedy and sampled, and the outputs follow the grammars."""
    import json
    import re

    from tokenizers import Tokenizer

    from router.grammar import json_schema_grammar, regex_grammar

    schema = {"type": "object", "required": ["k", "n"], "additionalProperties": False,
              "properties": {"k": {"enum": ["a", "b"]},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    grammars = [regex_grammar("[a-c]{2,5}-[0-9]"), json_schema_grammar(schema)]
    tp1 = run_tp(tiny_model_dir, 1, [], 24, tmp_path, grammars=grammars)
    tp2 = run_tp(tiny_model_dir, 2, [], 24, tmp_path, grammars=grammars)
    assert tp2[0] == tp2[1] == tp1[0]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    texts = [tok.decode(t[: t.index(2)] if 2 in t else t) for t in tp1[0]]
    assert re.fullmatch("[a-c]{2,5}-[0-9]", texts[0]) and re.fullmatch("[a-c]{2,5}-[0-9]", texts[2])
    assert json.loads(texts[1])["k"] in ("a", "b") and json.loads(texts[3])["k"] in ("a", "b")


def test_different_weights_are_detected(tiny_tp1: dict[str, Any], tmp_path: Path) -> None:
    """The comparison fails for another model (a guard that the check can fail)."""
    other = tmp_path / "other"
    hf = make_hf_model("llama", other)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    hf.save_pretrained(other)
    with pytest.raises(AssertionError):
        _assert_same(tiny_tp1, run_tp(other, 2, PROMPTS, 12, tmp_path))


def test_default_model_tp3_matches_tp1(default_model_dir: Path, tmp_path: Path) -> None:
    """SmolLM2-135M: 9 query heads and 3 KV heads over 3 ranks; 8 tokens per prompt."""
    prompts = [p for p in PROMPTS if len(p) <= 17]
    tp1 = run_tp(default_model_dir, 1, prompts, 8, tmp_path)
    tp3 = run_tp(default_model_dir, 3, prompts, 8, tmp_path)
    _assert_same(tp1, tp3)
