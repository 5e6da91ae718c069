"""``shardserve serve``'s replica-count flags and the Ray Serve options they become
(:func:`router.serve.app.scaling_options`); the scaling itself runs in
tests/e2e/test_serve_autoscaling.py."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingConfig

from router.cli import build_parser, serve_config_from_args
from router.serve.app import scaling_options
from router.serve.config import ServeConfig


def serve_flags(flags: str) -> ServeConfig:
    """The :class:`ServeConfig` of ``shardserve serve FLAGS``."""
    return serve_config_from_args(build_parser(environ={}).parse_args(["serve", *flags.split()]))


def test_autoscaling_flags_become_ray_serves_autoscaling_config() -> None:
    config = serve_flags(
        "--replicas 1 --min-replicas 1 --max-replicas 3 --target-ongoing-requests 2 "
        "--upscale-delay 1.5 --downscale-delay 4"
    )
    options = scaling_options(config)
    assert options == {
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 3,
            "initial_replicas": 1,
            "target_ongoing_requests": 2.0,
            "upscale_delay_s": 1.5,
            "downscale_delay_s": 4.0,
        }
    }
    ray_config = AutoscalingConfig(**options["autoscaling_config"])  # Ray Serve accepts it
    assert (ray_config.upscale_delay_s, ray_config.downscale_delay_s) == (1.5, 4.0)


def test_delays_default_to_ten_and_sixty_seconds() -> None:
    options = scaling_options(serve_flags("--max-replicas 4"))
    assert options["autoscaling_config"]["upscale_delay_s"] == 10.0
    assert options["autoscaling_config"]["downscale_delay_s"] == 60.0


def test_a_fixed_count_has_no_autoscaling_config() -> None:
    assert scaling_options(serve_flags("--replicas 3 --upscale-delay 1")) == {"num_replicas": 3}


@pytest.mark.parametrize("flag", ["--upscale-delay", "--downscale-delay"])
def test_a_negative_delay_is_refused_naming_its_flag(flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        serve_flags(f"--max-replicas 4 {flag} -1")
