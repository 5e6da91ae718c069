"""The ``shardserve launch`` flags: every one has help with its default (and choices)
and can come from ``SHARDSERVE_<FLAG>``; sizes take units. The checks walk the real
parser, so a flag added later is held to the same rules."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from router.cli import (
    SHARD_FLAG_SPELLINGS,
    build_parser,
    command_parser,
    config_from_args,
    env_names,
    parse_command_line,
)
from router.config import SchedulerConfig, ServerConfig, ValidationLimits, config_flags
from shard.config import ATTENTION_BACKENDS, ShardConfig, parse_size
from shard.config_flags import config_from_args as shard_config_from_args
from shard.config_flags import shard_argv, shard_flag


def launch_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    launch = command_parser(build_parser(environ or {}), "launch")
    return launch


def flags() -> list[argparse.Action]:
    return [action for action in launch_parser()._actions if env_names(action)]


def help_blocks(parser: argparse.ArgumentParser) -> dict[str, str]:
    """The help text of each flag, keyed by its first spelling, whitespace collapsed."""
    blocks: dict[str, str] = {}
    current = None
    for line in parser.format_help().splitlines():
        match = re.match(r"  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return {name: " ".join(text.split()) for name, text in blocks.items()}


@pytest.fixture(autouse=True)
def wide_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside variable names


def test_there_are_flags_to_check() -> None:
    assert len(flags()) >= 30


@pytest.mark.parametrize("action", flags(), ids=lambda a: a.option_strings[0])
def test_flag_help_shows_default_choices_and_variable(action: argparse.Action) -> None:
    assert action.help and len(action.help) > 5, f"{action.option_strings} has no help"
    block = help_blocks(launch_parser())[action.option_strings[0]]
    assert "default:" in block, block
    for name in env_names(action):
        assert name in block, block
    for choice in action.choices or ():
        assert str(choice) in block.split("choices:")[1], block


def sample(action: argparse.Action) -> tuple[str, Any]:
    """A value for the flag's variable and what the parsed flag must be."""
    if action.nargs == 0:
        return "true", action.const
    if action.choices is not None:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    if action.nargs == "+":
        return "first second", ["first", "second"]
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "0.25", 0.25
    if action.metavar == "SIZE":
        return "3MiB", 3 * 2**20
    return "some-value", "some-value"


@pytest.mark.parametrize("action", flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_reads_its_environment_variable(action: argparse.Action) -> None:
    raw, expected = sample(action)
    for name in env_names(action):
        args = build_parser({name: raw}).parse_args(["launch"])
        assert getattr(args, action.dest) == expected, name


def test_command_line_wins_over_the_environment() -> None:
    environ = {"SHARDSERVE_PORT": "1234", "SHARDSERVE_JSON_OUTPUT": "yes"}
    args = build_parser(environ).parse_args(["launch", "--port", "4321"])
    assert args.port == 4321 and args.json_output is True
    args = build_parser({"SHARDSERVE_JSON_OUTPUT": "off"}).parse_args(["launch"])
    assert args.json_output is False


def test_vllm_spellings_of_the_budgets_are_accepted() -> None:
    args = build_parser({}).parse_args(["launch", "--max-model-len", "2048",
                                        "--max-num-seqs", "16"])
    assert args.max_total_tokens == 2048 and args.max_batch_size == 16


def test_unknown_flag_is_reported_by_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_command_line(build_parser({}), ["launch", "--max-batch-total-tokens", "9"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "shardserve launch: error: unrecognized arguments: --max-batch-total-tokens 9" in err
    assert "usage: shardserve launch" in err


@pytest.mark.parametrize(("name", "raw"), [
    ("SHARDSERVE_PORT", "abc"), ("SHARDSERVE_EXECUTOR", "kubernetes"),
    ("SHARDSERVE_KV_CACHE_BYTES", "12XB"), ("SHARDSERVE_JSON_OUTPUT", "maybe"),
])
def test_bad_variable_is_an_error_naming_it(
    name: str, raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser({name: raw})
    assert exit_info.value.code == 2
    assert name in capsys.readouterr().err


def test_secret_flags_never_show_their_value() -> None:
    block = help_blocks(launch_parser({"SHARDSERVE_API_KEY": "hunter2"}))["--api-key"]
    assert "hunter2" not in block and "hidden" in block


@pytest.mark.parametrize(("text", "size"), [
    ("0", 0), ("4096", 4096), ("1GiB", 2**30), ("1gib", 2**30), ("1Gi", 2**30),
    ("512MiB", 512 * 2**20), ("2G", 2 * 10**9), ("2GB", 2 * 10**9), ("64k", 64_000),
    ("1.5KiB", 1536), (" 8 MiB ", 8 * 2**20), ("1T", 10**12), ("3b", 3),
])
def test_sizes_take_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "1XB", "-1", "1 2", "1e9", "1.2.3MiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_size_flags_take_units() -> None:
    args = build_parser({}).parse_args(["launch", "--kv-cache-bytes", "1GiB",
                                        "--max-request-bytes", "2M"])
    assert args.kv_cache_bytes == 2**30 and args.max_request_bytes == 2 * 10**6
    defaults = build_parser({}).parse_args(["launch"])
    assert defaults.kv_cache_bytes == 512 * 2**20 and defaults.max_request_bytes == 2**20


def test_attention_backend_choices_are_the_shard_registry() -> None:
    from shard.attention import ATTENTION_BACKENDS as REGISTRY

    assert set(ATTENTION_BACKENDS) == {"auto", *REGISTRY}
    assert build_parser({}).parse_args(["launch"]).attention_backend == "auto"


def test_shard_flags_of_launch_are_the_shard_configs(default_model_dir: Path) -> None:
    """launch's shard flags come from ShardConfig (same defaults and help), and what
    launch parses reaches the shards as one ShardConfig, which the local executor's
    argv carries to ``python -m shard.server`` unchanged."""
    blocks = help_blocks(launch_parser())
    default = ShardConfig(model_path="-")
    defaults = launch_parser().parse_args([])
    for name in ("dtype", "device", "load_format", "attention_backend", "cuda_graphs", "pdl",
                 "gemm_tuning", "gemm_tuning_cache", "block_size", "kv_cache_bytes",
                 "gpu_memory_fraction"):
        assert getattr(defaults, name) == getattr(default, name), name
        flag = "--" + name.replace("_", "-")
        assert shard_flag(name).help in blocks[flag], blocks[flag]
    assert defaults.num_shard == default.world_size
    assert "default: 512MiB" in blocks["--kv-cache-bytes"]

    args = launch_parser().parse_args([
        "--model", str(default_model_dir), "--kv-cache-bytes", "1GiB", "--block-size", "32",
        "--dtype", "float32", "--cuda-graphs", "0", "--pdl", "off", "--gemm-tuning", "off",
        "--gemm-tuning-cache", "/data/tuning", "--json-output"])
    config = config_from_args(args)
    assert config.shard == ShardConfig(
        model_path=str(default_model_dir), model_id=default_model_dir.name, dtype="float32",
        cuda_graphs="0", pdl="off", gemm_tuning="off", gemm_tuning_cache="/data/tuning",
        block_size=32, kv_cache_bytes=2**30, json_logs=True)
    rank = config.shard.for_rank(0, "127.0.0.1", 0)
    assert shard_config_from_args(shard_argv(rank, "127.0.0.1", 5000), environ={}) == (
        rank, "127.0.0.1", 5000)


def test_unknown_shardserve_variables_are_named_with_the_setting_meant() -> None:
    from router.cli import build_parser, unknown_env_names

    environ = {"SHARDSERVE_WORLD_SIZE": "2", "SHARDSERVE_JSON_LOGS": "1",
               "SHARDSERVE_MAX_BATCH_SIZ": "8", "SHARDSERVE_PORT": "8080",
               "SHARDSERVE_CACHE_DIR": "/tmp", "SHARDSERVE_NOTHING_LIKE_IT": "x", "HOME": "/"}
    unknown = dict(unknown_env_names(build_parser(environ={}), environ))
    assert unknown == {
        "SHARDSERVE_WORLD_SIZE": "SHARDSERVE_NUM_SHARD",  # the shard field's name
        "SHARDSERVE_JSON_LOGS": "SHARDSERVE_JSON_OUTPUT",
        "SHARDSERVE_MAX_BATCH_SIZ": "SHARDSERVE_MAX_BATCH_SIZE",  # a typo
        "SHARDSERVE_NOTHING_LIKE_IT": None,
    }


# What a flag's metavar may say: its unit, or the kind of text it takes.
UNIT_METAVARS = {"SECONDS", "TOKENS", "STEPS", "N", "SIZE", "SIZES", "PORT", "RATIO", "FRACTION",
                 "PATH", "DIR", "NAME", "HOST", "ADDRESS", "KEY", "DEVICE"}


@pytest.mark.parametrize("action", flags(), ids=lambda a: a.option_strings[0])
def test_every_flag_help_reads_the_same_way(action: argparse.Action) -> None:
    """One format: the help, then ``[choices: …; default: …; env: …]``; a value is named
    by its unit (SECONDS, TOKENS, N ...) or by its choices, never by argparse's
    upper-cased flag name (STEP_TIMEOUT)."""
    block = help_blocks(launch_parser())[action.option_strings[0]]
    assert "(default" not in block and block.count("default:") == 1, block
    assert re.search(r" \[(choices: [^;\]]+; )?default: [^\]]+; env: [A-Z_, ]+\]$", block), block
    if action.nargs != 0 and action.choices is None:
        assert action.metavar in UNIT_METAVARS, (action.option_strings, action.metavar)
    if action.type is float:
        assert not re.search(r"default: \d+\.0;", block), block  # 300, not 300.0


def test_launch_flags_are_the_config_fields_flags() -> None:
    """Each launch flag but --model is defined once, by a config field's metadata
    (router.config for the router's, ShardConfig for the shards'), and defaults to that
    field's default (derived ones to none; on/off for bools)."""
    by_dest = {action.dest: action for action in flags()}
    shard_fields = {field.name for field in dataclasses.fields(ShardConfig)}
    covered = {"model"} | {dest for dest in by_dest if dest in shard_fields}
    covered |= {SHARD_FLAG_SPELLINGS[name][2:].replace("-", "_") for name in SHARD_FLAG_SPELLINGS}
    for config_class in (SchedulerConfig, ValidationLimits, ServerConfig):
        for name, (flag, default) in config_flags(config_class).items():
            action = by_dest[flag.spelling(name)[2:].replace("-", "_")]
            if flag.default_text:
                assert action.default is None, name
            elif flag.type is bool:
                assert action.default == ("on" if default else "off"), name
            else:
                assert action.default == default, name
            covered.add(action.dest)
    assert set(by_dest) == covered, set(by_dest) - covered


def test_default_config_is_the_config_classes_defaults(default_model_dir: Path) -> None:
    config = config_from_args(launch_parser().parse_args(["--model", str(default_model_dir)]))
    assert config.limits == ValidationLimits()
    derived = SchedulerConfig()
    scheduler = dataclasses.replace(
        config.scheduler, max_batch_prefill_tokens=4096, max_input_tokens=2048,
        max_total_tokens=4096, max_batch_size=derived.max_batch_size,
        waiting_served_ratio=derived.waiting_served_ratio,
        max_concurrent_requests=derived.max_concurrent_requests,
        speculative_disable_batch_size=derived.speculative_disable_batch_size)
    assert scheduler == derived
    assert config.budget_flags == dict.fromkeys(
        ("max_batch_prefill_tokens", "max_input_tokens", "max_total_tokens", "max_batch_size",
         "waiting_served_ratio", "max_concurrent_requests", "speculative_disable_batch_size"))
    expected = ServerConfig(shard=config.shard, budget_flags=config.budget_flags,
                            served_model_names=(default_model_dir.name,))
    assert dataclasses.replace(config, scheduler=SchedulerConfig(),
                               limits=ValidationLimits()) == expected


@pytest.mark.parametrize(("flags", "message"), [
    (["--speculative-model", "/nonexistent/draft"],
     r"^--speculative-model /nonexistent/draft: expected a Hugging Face model folder"),
    (["--speculative-model", "{weightless}"],
     r"^--speculative-model .*weightless: no \*\.safetensors in"),
    (["--speculative-method", "ngram", "--speculative-model", "{model}"],
     r"^--speculative-model is the draft model of --speculative-method draft .* not of ngram"),
    (["--speculative-method", "draft"], r"^--speculative-method draft needs --speculative-model"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
     r"^--num-speculative-tokens 0: give 1 to 16 guesses with --speculative-method ngram"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "17"],
     r"^--num-speculative-tokens 17: give 1 to 16"),
])
def test_speculation_flags_refused_naming_the_flag(
        default_model_dir: Path, tmp_path: Path, flags: list[str], message: str) -> None:
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (weightless / name).write_bytes((default_model_dir / name).read_bytes())
    argv = ["--model", str(default_model_dir),
            *(f.format(weightless=weightless, model=default_model_dir) for f in flags)]
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        config_from_args(launch_parser().parse_args(argv))


def test_speculation_flags_accepted(default_model_dir: Path) -> None:
    config = config_from_args(launch_parser().parse_args([
        "--model", str(default_model_dir), "--speculative-method", "ngram",
        "--num-speculative-tokens", "16"]))
    assert config.scheduler.num_speculative_tokens == 16
    draft = config_from_args(launch_parser().parse_args([
        "--model", str(default_model_dir), "--speculative-model", str(default_model_dir)]))
    assert draft.shard.speculative_method == "draft"
    assert draft.scheduler.num_speculative_tokens == 4
