"""The README's gRPC examples run as shown against a real server (the tiny model, local
shards): the ``shardserve client`` line and the Python stubs, the address being the only
change; and the request limits of the README's flag table hold at their defaults."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.config import ValidationLimits
from tests.integration.live_server import LiveServer, launch_tiny

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
GRPC_SECTION = README[README.index("**gRPC**"):README.index("**Access.**")]
README_ADDRESS = "localhost:3001"


def code_block(language: str) -> str:
    """The first ``language`` code block of the README's gRPC section."""
    start = GRPC_SECTION.index(f"```{language}\n") + len(f"```{language}\n")
    return GRPC_SECTION[start:GRPC_SECTION.index("```", start)]


def shardserve() -> list[str]:
    """The ``shardserve`` command of this environment."""
    script = Path(sys.executable).parent / "shardserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "router.cli"]


def generated_text(server: LiveServer, prompt: str, max_new_tokens: int) -> str:
    """What the HTTP API answers for the same greedy request."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    text: str = response.json()["generated_text"]
    return text


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = launch_tiny(tiny_model_dir, tmp_path_factory.mktemp("readme-grpc") / "server.log")
    yield live
    live.stop()


@pytest.mark.parametrize("extra", [[], ["--stream"]], ids=["unary", "stream"])
def test_the_readme_client_line_prints_the_completion(server: LiveServer, extra: list[str]) -> None:
    line = code_block("bash").strip()
    assert line.startswith("shardserve client ") and README_ADDRESS in line, line
    argv = shlex.split(line.replace(README_ADDRESS, server.grpc_address))
    result = subprocess.run([*shardserve(), *argv[1:], *extra], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    prompt, max_new_tokens = argv[2], int(argv[argv.index("--max-new-tokens") + 1])
    text = generated_text(server, prompt, max_new_tokens)
    assert text and result.stdout == text + "\n"


def test_the_readme_python_example_prints_the_completion_twice(server: LiveServer) -> None:
    code = code_block("python")
    assert README_ADDRESS in code
    result = subprocess.run([sys.executable, "-c", code.replace(README_ADDRESS,
                                                                 server.grpc_address)],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    text = generated_text(server, "The capital of France is", 20)
    assert text and result.stdout == f"{text}\n{text}\n"  # Generate, then GenerateStream


def test_the_client_names_the_address_and_status_when_nothing_answers(
    tmp_path: Path,
) -> None:
    from tests.ports import unused_port

    address = f"127.0.0.1:{unused_port()}"
    result = subprocess.run([*shardserve(), "client", "Hi", "--address", address,
                             "--timeout", "20"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert f"shardserve client: {address}: UNAVAILABLE" in result.stderr, result.stderr


# What the defaults let an OpenAI client ask for: OpenAI's own limits of top_logprobs
# and stop, and the README's n (OpenAI's is 128).
OPENAI_TOP_LOGPROBS, OPENAI_STOP, README_N = 20, 4, 16


def test_the_flag_tables_request_limits_hold(server: LiveServer) -> None:
    """Requests of OpenAI's sizes pass at the defaults; one more than a limit is a 400
    naming the field and the flag."""
    limits = ValidationLimits()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def post(**fields: object) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", json=chat | fields, timeout=60)

    top = post(logprobs=True, top_logprobs=OPENAI_TOP_LOGPROBS)
    assert top.status_code == 200, top.text
    tokens = top.json()["choices"][0]["logprobs"]["content"]
    assert tokens and all(len(token["top_logprobs"]) == OPENAI_TOP_LOGPROBS
                          for token in tokens)
    many = post(n=README_N, temperature=1.0)
    assert many.status_code == 200, many.text
    assert len(many.json()["choices"]) == README_N
    stops = post(stop=[f"stop{i}" for i in range(OPENAI_STOP)])
    assert stops.status_code == 200, stops.text
    for fields, param, flag in [
        ({"n": limits.max_best_of + 1, "temperature": 1.0}, "n", "--max-best-of"),
        ({"stop": [f"stop{i}" for i in range(limits.max_stop_sequences + 1)]}, "stop",
         "--max-stop-sequences"),
    ]:
        response = post(**fields)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and flag in error["message"], error
    # OpenAI's own cap on top_logprobs (20) answers first there; TGI's field has only ours.
    assert post(logprobs=True, top_logprobs=21).json()["error"]["param"] == "top_logprobs"
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2,
                                           "top_n_tokens": limits.max_top_n_tokens + 1}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("top_n_tokens: must be <= "
                                               f"{limits.max_top_n_tokens} (--max-top-n-tokens)")
