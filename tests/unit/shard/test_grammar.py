"""Grammar-constrained decoding in the model runner (tiny random Llama with the default
model's tokenizer): outputs follow the grammar, unconstrained rows of the same step are
untouched, logprobs stay the model's, and the state survives a recompute."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from router.grammar import json_schema_grammar, regex_grammar
from shard.inputs import ModelInputs, SeqChunk, build_inputs
from shard.model_runner import ModelRunner
from shard.records import NewRequest, PrefillStep
from shard.sampling_types import SamplingParams
from tests.unit.shard.helpers import BLOCK_SIZE, BlockPool, DecodeDriver, make_runner, request

EOS = 2
PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 2]  # arbitrary ids of the real vocabulary
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}},
            "required": ["kind"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{2,4}!"


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return make_runner(tiny_model_dir, kv_cache_bytes=8 * 1024 * 1024)


@pytest.fixture(scope="module")
def text_of(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return lambda ids: tok.decode([t for t in ids if t != EOS], skip_special_tokens=False)


def run(
    runner: ModelRunner, requests: list[NewRequest], steps: int, pool: BlockPool
) -> dict[int, list[int]]:
    """Prefill ``requests`` then decode ``steps`` times; tokens per request (stopping
    a request after EOS is the router's job, so later tokens are kept here). The
    runner holds no request afterwards."""
    out = runner.prefill(PrefillStep(tuple(requests)))
    tokens = {g.request_id: [g.token_id] for g in out.generations}
    driver = DecodeDriver(runner, pool)
    for _ in range(steps):
        for rid, token in driver.step().items():
            tokens[rid].append(token)
    runner.reset()
    return tokens


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


def new_request(rid: int, pool: BlockPool, grammar: str = "", **sampling: object) -> NewRequest:
    blocks = pool.for_tokens(len(PROMPT) + 80)
    return request(rid, PROMPT, blocks, sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
                   grammar=grammar)


def test_regex_output_fullmatches_and_ends_with_eos(runner, text_of) -> None:
    pool = BlockPool(runner.num_blocks, seed=1)
    tokens = run(runner, [new_request(1, pool, regex_grammar(REGEX))], 30, pool)[1]
    assert EOS in tokens, "a complete grammar allows only EOS"
    assert re.fullmatch(REGEX, text_of(until_eos(tokens)))
    assert set(tokens[tokens.index(EOS):]) == {EOS}  # steps past the end stay at EOS


@pytest.mark.parametrize("do_sample", [False, True])
def test_json_schema_output_validates(runner, text_of, do_sample: bool) -> None:
    pool = BlockPool(runner.num_blocks, seed=2)
    grammar = json_schema_grammar(SCHEMA)
    reqs = [new_request(i, pool, grammar, do_sample=do_sample, seed=i) for i in (1, 2, 3)]
    tokens = run(runner, reqs, 70, pool)
    for rid in (1, 2, 3):
        assert EOS in tokens[rid], f"request {rid} did not finish its JSON"
        document = json.loads(text_of(until_eos(tokens[rid])))
        jsonschema.validate(document, SCHEMA)


def test_unconstrained_rows_are_unchanged_and_logprobs_unmasked(runner) -> None:
    pool = BlockPool(runner.num_blocks, seed=3)
    alone = run(runner, [new_request(2, pool), new_request(4, pool, do_sample=True, seed=7)],
                12, pool)
    pool = BlockPool(runner.num_blocks, seed=3)
    mixed_reqs = [
        new_request(1, pool, json_schema_grammar(SCHEMA)),
        new_request(2, pool),
        new_request(3, pool, regex_grammar(REGEX), do_sample=True, seed=3),
        new_request(4, pool, do_sample=True, seed=7),
    ]
    out = runner.prefill(PrefillStep(tuple(mixed_reqs)))
    mixed = {g.request_id: [g.token_id] for g in out.generations}
    # the constrained row's logprob is under the model's (unmasked) distribution
    with torch.inference_mode():
        logits = runner.model.compute_logits(
            runner.forward(_prompt_inputs(runner, mixed_reqs[0]))
        )[-1].log_softmax(-1)
    torch.testing.assert_close(
        torch.tensor(out.generations[0].logprob), logits[out.generations[0].token_id],
        atol=1e-5, rtol=1e-5,
    )
    assert out.generations[0].token_id != int(logits.argmax()), "the mask changed the pick"
    driver = DecodeDriver(runner, pool)
    for _ in range(12):
        for rid, token in driver.step().items():
            mixed[rid].append(token)
    runner.reset()
    assert mixed[2] == alone[2] and mixed[4] == alone[4]


def _prompt_inputs(runner: ModelRunner, r: NewRequest) -> ModelInputs:
    """Model inputs of ``r``'s whole prompt (its blocks are already written)."""
    return build_inputs([SeqChunk(r.input_ids, 0, r.block_ids, write_from=len(r.input_ids))],
                        BLOCK_SIZE, True, runner.device)


@pytest.mark.parametrize("do_sample", [False, True])
def test_recompute_rebuilds_the_grammar_state(runner, do_sample: bool) -> None:
    """A request preempted after k tokens and prefilled again with prompt + generated
    (num_generated = k) continues exactly as if it had never stopped."""
    grammar = json_schema_grammar(SCHEMA)
    pool = BlockPool(runner.num_blocks, seed=4)
    full = run(runner, [new_request(1, pool, grammar, do_sample=do_sample, seed=5)], 25, pool)[1]
    k = 9
    pool = BlockPool(runner.num_blocks, seed=5)
    ids = [*PROMPT, *full[:k]]
    again = request(1, ids, pool.for_tokens(len(ids) + 80),
                    sampling=SamplingParams(do_sample=do_sample, seed=5), grammar=grammar,
                    num_generated=k)
    rest = run(runner, [again], 25 - k, pool)[1]
    assert full[k:] == rest


def test_penalties_and_top_n_with_grammar(runner, text_of) -> None:
    pool = BlockPool(runner.num_blocks, seed=6)
    req = new_request(1, pool, regex_grammar(REGEX), repetition_penalty=1.3,
                      frequency_penalty=0.5)
    tokens = run(runner, [req], 30, pool)[1]
    assert re.fullmatch(REGEX, text_of(until_eos(tokens)))


def test_broken_grammar_fails_only_its_request(runner) -> None:
    pool = BlockPool(runner.num_blocks, seed=7)
    bad = regex_grammar("(unclosed")
    tokens = run(runner, [new_request(1, pool, bad), new_request(2, pool)], 3, pool)
    assert tokens[1] == [EOS] * 4
    pool = BlockPool(runner.num_blocks, seed=7)
    alone = run(runner, [new_request(2, pool)], 3, pool)
    assert tokens[2] == alone[2]


def test_grammar_that_fails_while_generating_is_reported(runner) -> None:
    # Compiles, but its lexer gives up on the first token it consumes (llguidance's
    # limit on constructed expressions): every step reports it until the router drops it.
    pool = BlockPool(runner.num_blocks, seed=7)
    failing = regex_grammar("a{1000000}")
    out = runner.prefill(PrefillStep((new_request(1, pool, failing), new_request(2, pool))))
    assert [rid for rid, _ in out.grammar_failures] == [1]
    assert "too many expressions" in out.grammar_failures[0][1]
    step = runner.decode()
    assert [rid for rid, _ in step.grammar_failures] == [1]
    runner.reset()
    pool = BlockPool(runner.num_blocks, seed=7)
    ok = runner.prefill(PrefillStep((new_request(3, pool, regex_grammar(REGEX)),)))
    assert ok.grammar_failures == ()
    runner.reset()


def test_matcher_templates_are_cached(runner) -> None:
    grammar = regex_grammar("[ab]{3}")
    first = runner.grammars.matcher(grammar, 1)
    cached = runner.grammars._templates[grammar]
    second = runner.grammars.matcher(grammar, 2)
    assert runner.grammars._templates[grammar] is cached
    assert first.matcher is not second.matcher  # each request owns its state


def test_pipelined_like_the_servicer_equals_one_step_at_a_time(runner) -> None:
    """Steps launched in one thread and each read in a thread of its own, as the
    servicer does (the next step launched before the previous is read): a prefill of
    grammar-constrained, penalized and seeded sampled rows joins running rows, and
    every token equals one step at a time."""
    import threading

    from shard.pending_step import PendingStep

    def reqs(pool: BlockPool) -> tuple[list[NewRequest], list[NewRequest]]:
        first = [new_request(1, pool), new_request(2, pool, do_sample=True, seed=5)]
        second = [
            new_request(3, pool, json_schema_grammar(SCHEMA)),
            new_request(4, pool, regex_grammar(REGEX), do_sample=True, seed=3),
            new_request(5, pool, repetition_penalty=1.5, frequency_penalty=0.5),
            new_request(6, pool, do_sample=True, seed=9),
        ]
        return first, second

    def steps(pipelined: bool) -> dict[int, list[int]]:
        pool = BlockPool(runner.num_blocks, seed=4)
        first, second = reqs(pool)
        got: dict[int, list[int]] = {}
        threads: list[threading.Thread] = []

        def finish(p) -> None:  # type: ignore[no-untyped-def]
            out = runner.finish_step(p) if isinstance(p, PendingStep) else p
            for g in out.generations:
                got.setdefault(g.request_id, []).append(g.token_id)

        def launch(step) -> None:  # type: ignore[no-untyped-def]
            p = step()
            if pipelined:
                t = threading.Thread(target=finish, args=(p,))
                t.start()
                threads.append(t)
            else:
                finish(p)

        launch(lambda: runner.launch_prefill(PrefillStep(tuple(first))))
        launch(lambda: runner.launch_decode())
        launch(lambda: runner.launch_prefill(PrefillStep(tuple(second))))
        for _ in range(15):
            launch(lambda: runner.launch_decode())
        for t in threads:
            t.join()
        runner.reset()
        return got

    assert steps(True) == steps(False)
