"""``--model-id`` means what it means in TGI (the model to load, an alias of
``--model``); the names the model is served as come from ``--served-model-name``."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from router.cli import build_parser
from tests.integration.live_server import launch_tiny


def test_model_id_is_an_alias_of_model() -> None:
    args = build_parser().parse_args(["launch", "--model-id", "/models/llama"])
    assert args.model == "/models/llama"
    args = build_parser().parse_args(["launch", "--model", "/models/llama"])
    assert args.model == "/models/llama"


def test_server_loads_the_model_id_folder_and_reports_served_names(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--served-model-name", "my-model", "alias"], model_flag="--model-id")
    try:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert info["model_id"] == "my-model"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["my-model", "alias"]
        completion = client.completions.create(model="alias", prompt="Hi", max_tokens=2)
        assert completion.model == "my-model"
    finally:
        server.stop()
    # Without --served-model-name the folder's name is reported.
    server = launch_tiny(tiny_model_dir, tmp_path / "server2.log", model_flag="--model-id")
    try:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
        assert info["model_id"] == tiny_model_dir.name
    finally:
        server.stop()


def test_served_model_names_must_differ(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = launch_tiny(tiny_model_dir, tmp_path / "server.log",
                         ["--served-model-name", "a", "a"], wait=False)
    assert server.process.wait(timeout=120) == 2
    assert "--served-model-name" in server.log()


@pytest.mark.parametrize("flag", ["--model", "--model-id"])
def test_help_says_what_model_flags_mean(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--help"])
    out = capsys.readouterr().out
    assert flag in out and "--served-model-name" in out
