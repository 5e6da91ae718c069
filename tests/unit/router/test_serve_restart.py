"""The rolling restart's pieces that need no Ray cluster (the restart itself runs in
tests/e2e/test_serve_replicas.py): its flag, where it is refused, and the replica
states it logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import build_parser, config_from_args, serve_config_from_args
from router.serve.app import build_app, one_at_a_time
from router.serve.builder import app_builder
from router.serve.restart import format_states, rolling_restart


@pytest.mark.parametrize("max_replicas", [1, 2, 5, 9, 10, 64])
def test_one_at_a_time_is_one_replica_for_every_count_up_to_the_most(max_replicas: int) -> None:
    fraction = one_at_a_time(max_replicas)
    assert 0.0 < fraction <= 1.0  # Ray Serve's bounds of rolling_update_percentage
    for replicas in range(1, max_replicas + 1):
        # Ray Serve's batch of a rolling update: max(int(fraction * replicas), 1)
        assert max(int(fraction * replicas), 1) == 1


def test_the_flag_is_off_unless_given() -> None:
    parser = build_parser(environ={})
    assert not serve_config_from_args(parser.parse_args(["serve"])).rolling_restart
    args = parser.parse_args(["serve", "--rolling-restart", "on"])
    assert serve_config_from_args(args).rolling_restart


def test_a_rolling_restart_needs_the_ray_address(default_model_dir: Path) -> None:
    args = build_parser(environ={}).parse_args(["serve", "--rolling-restart", "on"])
    assert rolling_restart(config_from_args(args), serve_config_from_args(args), build_app) == 2


def test_a_config_file_cannot_ask_for_a_rolling_restart() -> None:
    with pytest.raises(ValueError, match="--rolling-restart"):
        app_builder({"flags": "--replicas 2 --rolling-restart on"})


def test_states_are_logged_in_name_order() -> None:
    assert format_states({"STOPPING": 1, "RUNNING": 1, "STARTING": 1}) == (
        "RUNNING=1 STARTING=1 STOPPING=1"
    )
    assert format_states({}) == "none"
