"""Speculative decoding through the real server: two ``shardserve launch`` processes on
the repeating tiny model (its greedy text falls into runs, so n-gram guesses are
accepted), one with ``--speculative-method ngram --ngram-min 1`` and one without, get
the same requests through the ``openai`` package and ``text_generation``'s client and
answer them alike: greedy text alone and batched, logprobs and top logprobs, stop
sequences and stop tokens, ``max_tokens`` boundaries, seeded sampling with ``n`` and
``best_of``, a JSON schema, prefix-cache hits. ``/metrics`` shows that the guesses were
verified and accepted on one server and that none were made on the other."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import jsonschema
import openai
import pytest
from text_generation import Client

from tests.integration.live_server import LiveServer, launch_tiny

T = TypeVar("T")

# Six prompts of different lengths (2 to ~60 tokens), some repeating themselves.
PROMPTS = [
    "Hello",
    "The capital of France is",
    "one two three one two three one two three one two",
    "a b c d e f g a b c d e f g a b c d",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    " ".join(["the quick brown fox jumps over the lazy dog"] * 6),
]
# Its greedy text is the prompt's last token repeated: the speculative server guesses
# (and is right) from the first decode step on.
RUN_PROMPT = PROMPTS[5] + " putting"
MAX_TOKENS = 32
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},  # its digits repeat: guesses are accepted
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@dataclass
class Server:
    """A live server and its clients."""

    live: LiveServer
    openai: openai.OpenAI
    tgi: Client

    def metric(self, name: str) -> float:
        """The value of ``shardserve_<name>`` (a metric without labels) on ``/metrics``.

        Raises:
            AssertionError: the metric is not exposed.
        """
        text = httpx.get(f"{self.live.url}/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(f"shardserve_{name} "):
                return float(line.split()[1])
        raise AssertionError(f"no metric shardserve_{name}")

    def accepted(self) -> float:
        """Guesses accepted so far."""
        return self.metric("spec_decode_accepted_tokens_total")


@dataclass
class Pair:
    """The speculative server and the plain one; :meth:`both` sends a request to both."""

    spec: Server
    plain: Server
    pool: ThreadPoolExecutor

    def both(self, call: Callable[[Server], T]) -> tuple[T, T]:
        """``call`` on both servers at once: (speculative answer, plain answer)."""
        spec = self.pool.submit(call, self.spec)
        plain = self.pool.submit(call, self.plain)
        return spec.result(), plain.result()


def _server(live: LiveServer) -> Server:
    return Server(
        live,
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120),
        Client(live.url, timeout=120),
    )


@pytest.fixture(scope="module")
def pair(repeating_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("speculative-http")
    names = ["--served-model-name", "tiny"]
    spec = launch_tiny(
        repeating_model_dir,
        logs / "spec.log",
        [*names, "--speculative-method", "ngram", "--ngram-min", "1"],
        wait=False,
    )
    plain = launch_tiny(repeating_model_dir, logs / "plain.log", names, wait=False)
    try:
        spec.wait_healthy()
        plain.wait_healthy()
        with ThreadPoolExecutor(max_workers=16) as pool:
            yield Pair(_server(spec), _server(plain), pool)
    finally:
        spec.stop()
        plain.stop()


def complete(server: Server, prompt: str, **params: Any) -> openai.types.Completion:
    """A completion of ``prompt``: greedy, ``MAX_TOKENS`` tokens, EOS ignored, unless
    ``params`` say otherwise (``extra_body`` fields among them)."""
    body = {"max_tokens": MAX_TOKENS, "temperature": 0.0, **params}
    extra = {"ignore_eos": True, **body.pop("extra_body", {})}
    return server.openai.completions.create(model="tiny", prompt=prompt, extra_body=extra, **body)


def greedy_tokens(server: Server, prompt: str, max_new_tokens: int) -> list[tuple[int, str]]:
    """The greedy tokens (id, text) of ``prompt`` through ``text_generation``'s client."""
    response = server.tgi.generate(prompt, max_new_tokens=max_new_tokens)
    assert response.details is not None
    tokens = [(t.id, t.text) for t in response.details.tokens]
    assert "".join(text for _, text in tokens) == response.generated_text
    return tokens


def test_greedy_text_alone_and_six_concurrent_equal_without_speculation(pair: Pair) -> None:
    def alone(server: Server) -> list[str]:
        return [complete(server, p).choices[0].text for p in PROMPTS]

    def concurrent(server: Server) -> list[str]:
        futures = [pair.pool.submit(complete, server, p) for p in PROMPTS]
        return [f.result().choices[0].text for f in futures]

    accepted = pair.spec.accepted()
    spec_alone, plain_alone = pair.both(alone)
    assert spec_alone == plain_alone
    assert len(set(plain_alone)) == len(PROMPTS)  # the prompts lead somewhere different
    assert pair.spec.accepted() > accepted
    spec_batched, plain_batched = pair.both(concurrent)
    assert spec_batched == plain_batched == plain_alone


def test_logprobs_and_top_logprobs_equal_without_speculation(pair: Pair) -> None:
    def completion_logprobs(server: Server) -> openai.types.CompletionChoice:
        return complete(server, PROMPTS[2], logprobs=3).choices[0]

    spec, plain = pair.both(completion_logprobs)
    assert spec.logprobs is not None and plain.logprobs is not None
    assert spec.logprobs.tokens == plain.logprobs.tokens
    assert len(plain.logprobs.tokens or []) == MAX_TOKENS
    assert spec.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    spec_top, plain_top = spec.logprobs.top_logprobs or [], plain.logprobs.top_logprobs or []
    assert [list(t) for t in spec_top] == [list(t) for t in plain_top]
    for s, p in zip(spec_top, plain_top, strict=True):
        assert list(s.values()) == pytest.approx(list(p.values()), abs=1e-4)

    def chat_logprobs(server: Server) -> list[tuple[str, float, list[tuple[str, float]]]]:
        chat = server.openai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPTS[3]}],
            max_tokens=24,
            temperature=0.0,
            logprobs=True,
            top_logprobs=4,
            extra_body={"ignore_eos": True},
        )
        content = chat.choices[0].logprobs
        assert content is not None and content.content is not None
        return [
            (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
            for t in content.content
        ]

    spec_chat, plain_chat = pair.both(chat_logprobs)
    assert len(plain_chat) == 24
    assert [t[0] for t in spec_chat] == [t[0] for t in plain_chat]
    assert [[a[0] for a in t[2]] for t in spec_chat] == [[a[0] for a in t[2]] for t in plain_chat]
    assert [t[1] for t in spec_chat] == pytest.approx([t[1] for t in plain_chat], abs=1e-4)


def _run_start(ids: list[int], length: int) -> int:
    """Where the first run of ``length`` equal tokens in ``ids`` starts."""
    for i in range(len(ids) - length + 1):
        if len(set(ids[i : i + length])) == 1:
            return i
    raise AssertionError(f"no run of {length} equal tokens in {ids}")


def test_stop_sequence_and_stop_token_inside_a_run(pair: Pair) -> None:
    """The greedy text of prompt 2 has a run of one token repeated, whose third token
    onwards the speculative server emits as accepted guesses (each step: a guess and
    the target's token after it). A stop sequence of the run's first three tokens ends
    the text there on both servers (the target's token after it is dropped); the
    run's token as a stop token ends it at the run's start, before the run's guesses."""
    spec_tokens, tokens = pair.both(lambda s: greedy_tokens(s, PROMPTS[2], 40))
    assert spec_tokens == tokens
    ids = [i for i, _ in tokens]
    start = _run_start(ids, 6)
    full = "".join(text for _, text in tokens)
    stop = "".join(text for _, text in tokens[start : start + 3])

    accepted = pair.spec.accepted()
    spec, plain = pair.both(lambda s: complete(s, PROMPTS[2], max_tokens=40, stop=[stop]))
    assert pair.spec.accepted() > accepted
    assert spec.choices[0].text == plain.choices[0].text
    # OpenAI leaves the stop sequence out of the text
    assert plain.choices[0].text == full[: full.index(stop)]
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"
    assert spec.usage is not None and plain.usage is not None
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == start + 3

    def stop_token(server: Server) -> openai.types.Completion:
        return complete(
            server, PROMPTS[2], max_tokens=40, extra_body={"stop_token_ids": [ids[start]]}
        )

    spec, plain = pair.both(stop_token)
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason == "stop"
    assert spec.usage is not None and plain.usage is not None
    assert spec.usage.completion_tokens == plain.usage.completion_tokens == start + 1


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_max_tokens_is_never_exceeded(pair: Pair, max_tokens: int) -> None:
    """RUN_PROMPT alone, where every decode step but the last has a right guess (the
    last has room for one token only: no guess), then three other prompts at once."""
    accepted = pair.spec.accepted()
    alone = pair.both(lambda s: complete(s, RUN_PROMPT, max_tokens=max_tokens, logprobs=0))
    if max_tokens <= 2:
        assert pair.spec.accepted() == accepted
    else:
        assert pair.spec.accepted() > accepted

    def batch(server: Server) -> list[openai.types.Completion]:
        futures = [
            pair.pool.submit(complete, server, p, max_tokens=max_tokens, logprobs=0)
            for p in PROMPTS[2:5]
        ]
        return [f.result() for f in futures]

    spec, plain = pair.both(batch)
    for s, p in zip([alone[0], *spec], [alone[1], *plain], strict=True):
        assert s.choices[0].text == p.choices[0].text
        assert s.choices[0].finish_reason == p.choices[0].finish_reason == "length"
        assert s.usage is not None and s.usage.completion_tokens == max_tokens
        assert s.choices[0].logprobs is not None
        assert len(s.choices[0].logprobs.tokens or []) == max_tokens


def test_seeded_sampling_with_n_and_best_of_equals_without_speculation(pair: Pair) -> None:
    def sampled(server: Server) -> tuple[list[str], list[str], list[str]]:
        n2 = complete(server, RUN_PROMPT, temperature=0.5, seed=7, n=2, extra_body={"top_k": 20})
        best = complete(server, PROMPTS[2], temperature=0.8, seed=11, n=1, best_of=3)
        tgi = server.tgi.generate(
            PROMPTS[2], max_new_tokens=24, do_sample=True, temperature=0.9, seed=5
        )
        # text_generation's client refuses a seed with best_of > 1; the server takes it
        body = {
            "inputs": PROMPTS[3],
            "parameters": {
                "max_new_tokens": 24,
                "do_sample": True,
                "seed": 9,
                "best_of": 2,
                "details": True,
            },
        }
        tgi_best = httpx.post(f"{server.live.url}/generate", json=body, timeout=120)
        assert tgi_best.status_code == 200, tgi_best.text
        best_of = tgi_best.json()
        return (
            [c.text for c in n2.choices],
            [c.text for c in best.choices],
            [
                tgi.generated_text,
                best_of["generated_text"],
                *(s["generated_text"] for s in best_of["details"]["best_of_sequences"]),
            ],
        )

    accepted = pair.spec.accepted()
    spec, plain = pair.both(sampled)
    assert pair.spec.accepted() > accepted
    assert spec == plain
    n2, best, tgi = plain
    assert len(n2) == 2 and n2[0] != n2[1]  # seeds 7 and 8
    assert len(best) == 1 and len(tgi) == 3


def test_json_schema_output_validates_and_equals_without_speculation(pair: Pair) -> None:
    def structured(server: Server) -> list[str]:
        chat = server.openai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a person."}],
            max_tokens=120,
            temperature=1.0,
            seed=3,
            n=2,
            response_format={
                "type": "json_schema",  # type: ignore[arg-type]
                "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
            },
        )
        return [c.message.content or "" for c in chat.choices]

    accepted = pair.spec.accepted()
    spec, plain = pair.both(structured)
    assert pair.spec.accepted() > accepted
    assert spec == plain
    for text in plain:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_prefix_cache_hits_give_the_same_text(pair: Pair) -> None:
    """A long prompt sent twice: the second hits the prefix cache on both servers; then
    the prompt followed by its own completion, whose cached blocks hold generated
    tokens (on the speculative server, accepted guesses)."""
    prompt = "Twice: " + RUN_PROMPT

    def three(server: Server) -> tuple[list[str], list[float]]:
        hits = [server.metric("prefix_cache_hit_tokens_total")]
        texts = []
        for text in (prompt, prompt):
            texts.append(complete(server, text).choices[0].text)
            hits.append(server.metric("prefix_cache_hit_tokens_total"))
        texts.append(complete(server, prompt + texts[0]).choices[0].text)
        hits.append(server.metric("prefix_cache_hit_tokens_total"))
        return texts, hits

    accepted = pair.spec.accepted()
    (spec_texts, spec_hits), (plain_texts, plain_hits) = pair.both(three)
    assert pair.spec.accepted() > accepted
    assert spec_texts == plain_texts
    assert spec_texts[0] == spec_texts[1]
    for hits in (spec_hits, plain_hits):
        assert hits[2] > hits[1]  # the second request hit the cache
        # the third hit more than the prompt: blocks of the first one's generated tokens
        assert hits[3] - hits[2] > hits[2] - hits[1]


def test_metrics_show_accepted_guesses_only_with_speculation(pair: Pair) -> None:
    pair.both(lambda s: complete(s, PROMPTS[2]))
    accepted = pair.spec.metric("spec_decode_accepted_tokens_total")
    proposed = pair.spec.metric("spec_decode_proposed_tokens_total")
    assert 0 < accepted <= proposed
    assert pair.plain.metric("spec_decode_proposed_tokens_total") == 0
    assert pair.plain.metric("spec_decode_accepted_tokens_total") == 0
