"""Speculative Decodes with a draft model (``--speculative-method draft``): the draft's
cache shares the target's blocks and catches up lazily; greedy rows emit transformers'
tokens whatever the draft, a copy of the target as draft has every guess accepted (also
when sampling: p and q are warped alike), and a draft with another vocabulary is
refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from shard.config import ShardConfig
from shard.model_runner import ModelRunner
from shard.records import PrefillStep
from shard.sampling_types import SamplingParams
from shard.speculative.draft import DraftProposer
from tests.conftest import TOKENIZER_FILES
from tests.unit.shard.helpers import DEVICE, BlockPool, request
from tests.unit.shard.test_speculative_step import SpecDriver

PROMPTS = [[504, 3458, 314, 253, 1345, 28], [17, 4096, 3000, 88], [1, 2000] * 9]
NEW_TOKENS = 24


def copy_model(source: Path, folder: Path, scale: float | None = None) -> Path:
    """``source`` saved again into ``folder`` (its layers' outputs times ``scale``)."""
    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32)
    if scale is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(scale)
                layer.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def drafts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"copy": copy_model(tiny_model_dir, tmp_path_factory.mktemp("draft-copy")),
            "other": copy_model(tiny_model_dir, tmp_path_factory.mktemp("draft-other"), 0.5)}


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        with torch.inference_mode():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        out.append(ids[0, len(prompt):].tolist())
    return out


def draft_runner(target: Path, draft: Path) -> ModelRunner:
    runner = ModelRunner(ShardConfig(
        model_path=str(target), device=DEVICE, dtype="float32", block_size=4,
        kv_cache_bytes=4 * 1024 * 1024, gpu_memory_fraction=0.3,
        speculative_method="draft", speculative_model=str(draft)))
    runner.warmup(max_batch_prefill_tokens=64, max_total_tokens=128)
    return runner


def generate(runner: ModelRunner, k: int, sampling: SamplingParams | None = None,
             new_tokens: int = NEW_TOKENS) -> tuple[list[list[int]], int, int]:
    """Each prompt's first ``new_tokens`` tokens through speculative Decodes of ``k``
    guesses; and the guesses accepted and proposed."""
    pool = BlockPool(runner.num_blocks, seed=7)
    out = runner.prefill(PrefillStep(tuple(
        request(i, p, pool.for_tokens(len(p)), sampling=sampling)
        for i, p in enumerate(PROMPTS))))
    tokens = {g.request_id: [g.token_id] for g in out.generations}
    driver = SpecDriver(runner, pool, k=k)
    accepted = proposed = 0
    while min(len(t) for t in tokens.values()) < new_tokens:
        got, _, counts = driver.spec_step()
        for rid, toks in got.items():
            tokens[rid].extend(toks)
        accepted += sum(counts) - len(counts)
        proposed += k * len(counts)
    runner.reset()
    return [tokens[i][:new_tokens] for i in range(len(PROMPTS))], accepted, proposed


def test_a_copy_of_the_target_has_every_greedy_guess_accepted(
        tiny_model_dir, drafts, expected) -> None:
    runner = draft_runner(tiny_model_dir, drafts["copy"])
    assert isinstance(runner.speculator.proposer, DraftProposer)  # type: ignore[union-attr]
    assert runner.draft is not None and runner.draft.kv_cache[0].num_blocks == runner.num_blocks
    tokens, accepted, proposed = generate(runner, k=3)
    assert tokens == expected
    assert accepted == proposed > 0


def test_another_draft_changes_nothing_in_greedy_output(tiny_model_dir, drafts, expected
                                                        ) -> None:
    runner = draft_runner(tiny_model_dir, drafts["other"])
    tokens, accepted, proposed = generate(runner, k=4)
    assert tokens == expected
    assert 0 <= accepted < proposed


def test_sampled_guesses_of_a_copy_are_all_accepted(tiny_model_dir, drafts) -> None:
    """q equals p when the draft is the target: warped alike (temperature, top-k,
    top-p, penalties), every guess passes the rule."""
    runner = draft_runner(tiny_model_dir, drafts["copy"])
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=20, min_p=0.05, seed=5,
                            repetition_penalty=1.1)
    _, accepted, proposed = generate(runner, k=3, sampling=params, new_tokens=9)
    assert accepted == proposed > 0


def test_a_draft_with_another_vocabulary_is_refused(tiny_model_dir, drafts, tmp_path) -> None:
    other = Path(shutil.copytree(drafts["other"], tmp_path / "renamed"))
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    word = list(vocab)[1000]  # an ordinary token, not an added one
    vocab[word + "_x"] = vocab.pop(word)
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"vocabulary differs .* in 2 tokens"):
        draft_runner(tiny_model_dir, other)


def test_a_copy_catches_up_after_plain_steps_with_other_budgets(
        tiny_model_dir, drafts, expected) -> None:
    """Speculative steps between runs of plain Decodes (1 to 10 tokens the draft has
    not computed: decode rows up to ``CATCH_UP_ROWS``, a varlen forward past it), row 0
    with one guess a step and the others three: a copy of the target still has every
    guess accepted, and the tokens are transformers'."""
    runner = draft_runner(tiny_model_dir, drafts["copy"])
    pool = BlockPool(runner.num_blocks, seed=3)
    out = runner.prefill(PrefillStep(tuple(
        request(i, p, pool.for_tokens(len(p))) for i, p in enumerate(PROMPTS))))
    tokens = {g.request_id: [g.token_id] for g in out.generations}
    driver = SpecDriver(runner, pool, k=3, bounds={0: 2})
    accepted = proposed = 0
    for plain in (0, 1, 9, 0):
        for _ in range(plain):
            for rid, tok in driver.step().items():
                tokens[rid].append(tok)
        got, _, counts = driver.spec_step()
        for rid, toks in got.items():
            tokens[rid].extend(toks)
        assert len(counts) == len(PROMPTS)
        accepted += sum(counts) - len(counts)
        proposed += 1 + 3 * (len(counts) - 1)
    runner.reset()
    assert accepted == proposed
    assert [t[:NEW_TOKENS] for t in tokens.values()] == [
        expected[i][:len(tokens[i])] for i in tokens]
    assert min(len(t) for t in tokens.values()) == 1 + 10 + 4 * 2  # row 0
