"""The README and the Makefile say what the code does: the flag table's defaults are
the parser's (whose are the config classes'), the request limits are in it, the GPU and
Ray-authentication sections exist, and ``make test`` prints why tests were skipped.
(tests/integration/test_readme_grpc.py runs the README's gRPC examples.)"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from router.cli import build_parser
from router.config import ValidationLimits
from shard.config import parse_size

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def launch_actions() -> dict[str, argparse.Action]:
    parser = build_parser({})
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {option: action for action in subparsers.choices["launch"]._actions
            for option in action.option_strings}


def agrees(cell: str, value: object) -> bool:
    """Whether a README default cell states ``value`` (prose stands for derived ones)."""
    if value is None:
        return True
    if isinstance(value, bool):
        return cell == ("on" if value else "off")
    if isinstance(value, int | float):
        try:
            return float(cell) == value
        except ValueError:
            return parse_size(cell) == value
    return cell == value or (cell == "none" and value == "")  # an empty path: none


def test_flag_table_defaults_are_the_parsers() -> None:
    actions = launch_actions()
    defaults = vars(build_parser({}).parse_args(["launch"]))
    table = README[README.index("Main flags"):README.index("## Running on a GPU")]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `--")]
    assert len(rows) >= 20
    for flags_cell, default_cell in rows:
        flags = re.findall(r"`(--[a-z-]+)", flags_cell)
        cells = [c.strip().strip("`") for c in default_cell.split(" / ")]
        for flag, cell in zip(flags, cells, strict=False):
            assert flag in actions, f"README lists {flag}, which launch does not know"
            value = defaults[actions[flag].dest]
            assert agrees(cell, value), f"README: {flag} defaults to {cell}; parser: {value}"


def test_flag_table_lists_the_request_limits() -> None:
    """The limits a newcomer's first requests meet (OpenAI's n, top_logprobs, stop)."""
    table = README[README.index("Main flags"):README.index("## Running on a GPU")]
    limits = ValidationLimits()
    for flag, value in (("--max-stop-sequences", limits.max_stop_sequences),
                        ("--max-top-n-tokens", limits.max_top_n_tokens),
                        ("--max-best-of", limits.max_best_of)):
        rows = [line for line in table.splitlines() if line.startswith(f"| `{flag}` |")]
        assert len(rows) == 1, f"the flag table has no row of {flag}"
        assert rows[0].split("|")[2].strip() == str(value), rows[0]


def test_readme_explains_gpus_and_ray_authentication() -> None:
    gpu = README[README.index("## Running on a GPU"):README.index("## APIs")]
    assert "CUDA build of PyTorch" in gpu and "--attention-backend auto" in gpu
    for backend in ("flash_attn", "triton", "torch"):
        assert backend in gpu
    ray_auth = README[README.index("### Ray's token authentication"):]
    for mode in ("unset", "`token`", "`disabled`", "~/.ray/auth_token"):
        assert mode in ray_auth


def test_make_test_prints_skip_reasons() -> None:
    makefile = (REPO / "Makefile").read_text()
    pytest_lines = [line for line in makefile.splitlines() if "/pytest" in line]
    assert pytest_lines and all(" -rs" in line for line in pytest_lines), pytest_lines
