"""deploy/kuberay: KubeRay objects valid against the CRD schemas, wired to the server."""

from __future__ import annotations

import copy
import os
from functools import cache
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.helpers import (
    DEPLOY,
    KUBERAY_SCHEMAS,
    Object,
    container_port,
    load_yaml,
    one,
    parse_launch_args,
    quantity_gib,
    split_entrypoint,
)
from tests.deploy.kustomize import render
from tests.deploy.test_dockerfile import arg_defaults, parse_dockerfile, runtime_uid

CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayService": "ray.io_rayservices.yaml"}


def _closed(schema: Any) -> Any:
    """The schema with unknown fields forbidden wherever the API server would drop them.

    A CRD's openAPIV3Schema lists known fields without `additionalProperties: false`; the
    API server prunes the rest silently, so a typo would deploy as a missing setting.
    """
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if ("properties" in closed and "additionalProperties" not in closed
            and not closed.get("x-kubernetes-preserve-unknown-fields")):
        closed["additionalProperties"] = False
    return closed


@cache
def _require_schemas() -> None:
    """The CRD schemas live beside the checkout (../shared/schemas/kuberay), as in CI.
    CI must have them; a plain clone without that folder skips, saying why."""
    present = all((KUBERAY_SCHEMAS / name).is_file() for name in CRD_FILES.values())
    if not present and os.environ.get("CI") != "true":
        pytest.skip(f"KubeRay CRD schemas not found in {KUBERAY_SCHEMAS} (needed by CI only)")


def crd_schema(kind: str) -> dict[str, Any]:
    _require_schemas()
    crd = load_yaml(KUBERAY_SCHEMAS / CRD_FILES[kind])
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"], f"{kind} v1 is not served"
    schema: dict[str, Any] = _closed(version["schema"]["openAPIV3Schema"])
    return schema


@pytest.fixture(scope="module")
def objects() -> list[Object]:
    return render(DEPLOY / "kuberay")


@pytest.fixture(scope="module")
def cluster(objects: list[Object]) -> Object:
    return one(objects, "RayCluster")


@pytest.fixture(scope="module")
def job_args(objects: list[Object]) -> list[str]:
    words = split_entrypoint(one(objects, "RayJob")["spec"]["entrypoint"])
    assert words[:2] == ["shardserve", "launch"]
    return words[2:]


def _head(cluster: Object) -> tuple[Object, Object]:
    template = cluster["spec"]["headGroupSpec"]["template"]
    return template, template["spec"]["containers"][0]


def _templates(cluster: Object) -> list[Object]:
    spec = cluster["spec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"]
                                                  for g in spec["workerGroupSpecs"]]


def test_ray_objects_match_the_crd_schemas(objects: list[Object]) -> None:
    ray_objects = [obj for obj in objects if obj["apiVersion"].startswith("ray.io/")]
    assert {obj["kind"] for obj in ray_objects} == {"RayCluster", "RayJob"}
    for obj in ray_objects:
        assert obj["apiVersion"] == "ray.io/v1"
        jsonschema.validate(obj, crd_schema(obj["kind"]))


def test_crd_validation_catches_a_typo(cluster: Object) -> None:
    broken = copy.deepcopy(cluster)
    broken["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        jsonschema.validate(broken, crd_schema("RayCluster"))


def test_pod_templates_match_kubernetes_schemas(cluster: Object) -> None:
    for template in _templates(cluster):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "check"}, "template": template}
        kubernetes_validate.validate(pod_template, kubernetes_validate.latest_version(),
                                     strict=True)


def test_other_objects_match_kubernetes_schemas(objects: list[Object]) -> None:
    for obj in objects:
        if not obj["apiVersion"].startswith("ray.io/"):
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_job_runs_on_the_cluster_and_keeps_it(objects: list[Object], cluster: Object) -> None:
    job = one(objects, "RayJob")["spec"]
    assert job["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert "rayClusterSpec" not in job
    assert job["shutdownAfterJobFinishes"] is False


def test_job_launches_across_the_cluster(job_args: list[str]) -> None:
    flags = parse_launch_args(job_args)
    assert flags.ray_address == "auto"
    assert flags.placement == "spread"
    assert flags.executor == "ray"


def test_num_shard_equals_worker_gpus(cluster: Object, job_args: list[str]) -> None:
    flags = parse_launch_args(job_args)
    gpus = 0
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        [container] = group["template"]["spec"]["containers"]
        gpus += group["replicas"] * int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert flags.num_shard == gpus
    # The head runs the router only: no GPU advertised to Ray, none requested.
    _, head = _head(cluster)
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})


def test_every_ray_pod_has_memory_backed_shm_and_read_only_models(
        cluster: Object, job_args: list[str]) -> None:
    flags = parse_launch_args(job_args)
    for template in _templates(cluster):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        container = template["spec"]["containers"][0]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        assert quantity_gib(shm["sizeLimit"]) < quantity_gib(
            container["resources"]["limits"]["memory"])
        [model_mount] = [m for path, m in mounts.items()
                         if flags.model.startswith(path.rstrip("/") + "/")]
        assert model_mount["readOnly"] is True
        assert "persistentVolumeClaim" in volumes[model_mount["name"]]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_OFFLINE"] == "1"
        assert template["spec"]["securityContext"]["runAsUser"] == runtime_uid()


def test_shutdown_leaves_time_for_the_graceful_timeout(
        cluster: Object, job_args: list[str]) -> None:
    flags = parse_launch_args(job_args)
    graceful = flags.graceful_timeout
    _, head = _head(cluster)
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) > graceful
    for template in _templates(cluster):
        assert template["spec"]["terminationGracePeriodSeconds"] > graceful


def test_service_reaches_the_router_on_the_head(
        objects: list[Object], cluster: Object, job_args: list[str]) -> None:
    flags = parse_launch_args(job_args)
    service = one(objects, "Service")
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                           "ray.io/node-type": "head"}
    _, head = _head(cluster)
    targets = {port["name"]: container_port(head, port["targetPort"])
               for port in service["spec"]["ports"]}
    assert targets == {"http": flags.port, "grpc": flags.grpc_port}


def test_ray_version_matches_the_image(cluster: Object) -> None:
    assert cluster["spec"]["rayVersion"] == arg_defaults(parse_dockerfile())["RAY_VERSION"]


def test_images_are_pinned(cluster: Object) -> None:
    for template in _templates(cluster):
        for container in template["spec"]["containers"]:
            tag = container["image"].rpartition(":")[2]
            assert tag and tag != "latest" and "/" not in tag


def test_schemas_folder_is_present() -> None:
    _require_schemas()
    assert all((KUBERAY_SCHEMAS / name).is_file() for name in CRD_FILES.values()), \
        f"KubeRay CRDs expected in {KUBERAY_SCHEMAS}"
