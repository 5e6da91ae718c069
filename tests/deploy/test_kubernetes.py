"""The rendered Kubernetes manifests: valid objects that fit the server they run."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.deploy.helpers import (
    Object,
    by_kind,
    container_port,
    expand_env_refs,
    one,
    parse_launch_args,
    quantity_gib,
    router_paths,
)

# Oldest Kubernetes the manifests target, and the newest schemas bundled.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CUSTOM_API_VERSIONS = {"ray.io/v1", "monitoring.coreos.com/v1"}  # checked elsewhere
MIN_STARTUP_SECONDS = 20 * 60  # loading a large model from a network volume


def _server_container(objects: list[Object]) -> tuple[Object, Object]:
    pod = one(objects, "Deployment")["spec"]["template"]
    [container] = [c for c in pod["spec"]["containers"] if c["name"] == "shardserve"]
    return pod, container


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_objects_match_kubernetes_schemas(rendered: list[Object], version: str) -> None:
    for obj in rendered:
        if obj["apiVersion"] in CUSTOM_API_VERSIONS:
            continue
        # strict: unknown fields (typos) are errors, as `kubectl apply` would report.
        kubernetes_validate.validate(obj, version, strict=True)


def test_no_object_escapes_validation(rendered: list[Object]) -> None:
    for obj in rendered:
        if obj["apiVersion"] not in CUSTOM_API_VERSIONS:
            continue
        assert obj["kind"] in {"RayCluster", "RayJob", "ServiceMonitor"}, obj["kind"]


def test_schema_validation_catches_a_typo(rendered: list[Object]) -> None:
    obj = next(o for o in rendered if o["apiVersion"] not in CUSTOM_API_VERSIONS)
    broken = {**obj, "spec": {**obj["spec"], "replicaz": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_container_args_are_valid_launch_flags(server: list[Object]) -> None:
    _, container = _server_container(server)
    args = expand_env_refs(container["args"], container.get("env", []))
    flags = parse_launch_args(args)
    assert flags.executor == "ray"
    assert flags.graceful_timeout > 0 and flags.grpc_port > 0


def test_probes_hit_the_routers_health_route_on_its_port(server: list[Object]) -> None:
    _, container = _server_container(server)
    flags = parse_launch_args(expand_env_refs(container["args"], container.get("env", [])))
    paths = router_paths()
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == "/health", probe_name
        assert probe["path"] in paths, f"{probe_name}: the router serves no {probe['path']}"
        assert container_port(container, probe["port"]) == flags.port, probe_name


def test_startup_probe_allows_for_model_loading(server: list[Object]) -> None:
    _, container = _server_container(server)
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= MIN_STARTUP_SECONDS


def test_grace_period_exceeds_graceful_timeout(server: list[Object]) -> None:
    pod, container = _server_container(server)
    flags = parse_launch_args(expand_env_refs(container["args"], container.get("env", [])))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = flags.graceful_timeout + int(pre_stop[1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > needed


def test_service_routes_to_the_server_ports(server: list[Object]) -> None:
    pod, container = _server_container(server)
    flags = parse_launch_args(expand_env_refs(container["args"],
                                                      container.get("env", [])))
    service = one(server, "Service")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    targets = {port["name"]: container_port(container, port["targetPort"])
               for port in service["spec"]["ports"]}
    assert targets == {"http": flags.port, "grpc": flags.grpc_port}


def test_pdb_selects_the_server_pods(server: list[Object]) -> None:
    pod, _ = _server_container(server)
    pdb = one(server, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_service_monitor_scrapes_metrics_on_the_http_port(server: list[Object]) -> None:
    monitor = one(server, "ServiceMonitor")
    service = one(server, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"


def test_router_serves_the_metrics_path() -> None:
    assert "/metrics" in router_paths()


def test_gpus_match_num_shard(server: list[Object]) -> None:
    _, container = _server_container(server)
    flags = parse_launch_args(expand_env_refs(container["args"], container.get("env", [])))
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    if flags.device == "cpu":
        assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in requests
        return
    assert int(limits["nvidia.com/gpu"]) == flags.num_shard
    assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"]


def test_dev_shm_is_memory_backed_and_fits_the_memory_limit(server: list[Object]) -> None:
    pod, container = _server_container(server)
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    shm = quantity_gib(volume["emptyDir"]["sizeLimit"])
    assert 1 <= shm < quantity_gib(container["resources"]["limits"]["memory"])


def test_model_loads_offline_from_a_read_only_volume(server: list[Object]) -> None:
    pod, container = _server_container(server)
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    flags = parse_launch_args(expand_env_refs(container["args"], container.get("env", [])))
    if flags.model is None:  # the default model built into the image
        assert not any(m["mountPath"] == "/models" for m in container["volumeMounts"])
        return
    [mount] = [m for m in container["volumeMounts"]
               if flags.model.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount["readOnly"] is True
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert claim in {pvc["metadata"]["name"] for pvc in by_kind(server,
                                                                "PersistentVolumeClaim")}


def test_runs_as_the_images_non_root_user(server: list[Object]) -> None:
    from tests.deploy.test_dockerfile import runtime_uid

    pod, container = _server_container(server)
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == runtime_uid()
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_image_has_a_pinned_tag(server: list[Object]) -> None:
    _, container = _server_container(server)
    name, _, tag = container["image"].rpartition(":")
    assert name and tag and tag != "latest" and "/" not in tag
