"""deploy/kuberay-service: the RayService of `shardserve serve` is valid against the CRD
schema and the Kubernetes schemas, and deploys what the CLI accepts."""

from __future__ import annotations

import importlib
import shlex
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.cli import build_parser, config_from_args, serve_config_from_args
from tests.deploy.helpers import DEPLOY, load_yaml
from tests.deploy.test_kuberay import crd_schema

MANIFEST = DEPLOY / "kuberay-service" / "rayservice.yaml"


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    return dict(load_yaml(MANIFEST))


@pytest.fixture(scope="module")
def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    return dict(yaml.safe_load(service["spec"]["serveConfigV2"]))


def flags(serve_config: dict[str, Any]) -> list[str]:
    [app] = serve_config["applications"]
    return ["serve", *shlex.split(app["args"]["flags"])]


def test_matches_the_crd_schema(service: dict[str, Any]) -> None:
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    jsonschema.validate(service, crd_schema("RayService"))


def test_a_typo_is_caught(service: dict[str, Any]) -> None:
    broken = {**service, "spec": {**service["spec"], "serviceUnhealthySecondTreshold": 1}}
    with pytest.raises(jsonschema.ValidationError, match="Treshold"):
        jsonschema.validate(broken, crd_schema("RayService"))


def test_pod_templates_match_kubernetes_schemas(service: dict[str, Any]) -> None:
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]]
    for template in templates:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "check"}, "template": template}
        kubernetes_validate.validate(pod_template, kubernetes_validate.latest_version(),
                                     strict=True)
        [container] = template["spec"]["containers"]
        assert "livenessProbe" in container and "readinessProbe" in container


def test_the_application_is_ours_and_its_flags_parse(serve_config: dict[str, Any]) -> None:
    [app] = serve_config["applications"]
    module, name = app["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), name))
    args = build_parser().parse_args(flags(serve_config))
    replicas = serve_config_from_args(args)
    assert replicas.autoscaling and replicas.routing == "affinity"
    for path in serve_config["grpc_options"]["grpc_servicer_functions"]:
        module, _, function = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), function))


def test_workers_hold_the_most_replicas(service: dict[str, Any],
                                        serve_config: dict[str, Any]) -> None:
    args = build_parser().parse_args(flags(serve_config))
    _, most = serve_config_from_args(args).scale_bounds
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    [group] = cluster["workerGroupSpecs"]
    [container] = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert group["maxReplicas"] * gpus >= most * args.num_shard
    assert group["template"]["spec"]["terminationGracePeriodSeconds"] > args.graceful_timeout


def test_config_from_the_flags_validates(serve_config: dict[str, Any],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The server flags are valid as `launch` reads them (the model folder is the
    cluster's: resolving it is stubbed)."""
    import router.cli as cli

    class Files:
        path = "/models/llama-3-8b-instruct"
        model_id = "llama-3-8b-instruct"

    monkeypatch.setattr(cli, "resolve_model", lambda _: Files())
    monkeypatch.setattr(cli, "check_tp_size_for_folder", lambda *_: None)
    config = config_from_args(build_parser().parse_args(flags(serve_config)))
    assert config.graceful_timeout_s == 60 and config.shard.world_size == 1
