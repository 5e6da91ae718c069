"""Every kustomization renders, and the offline renderer agrees with kustomize itself."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.helpers import DEPLOY, KUSTOMIZATIONS, Object
from tests.deploy.kustomize import (
    UnsupportedKustomization,
    apply_strategic_merge,
    object_key,
    render,
)


def test_every_expected_kustomization_exists() -> None:
    names = {str(path.relative_to(DEPLOY)) for path in KUSTOMIZATIONS}
    assert {"kubernetes/base", "kubernetes/overlays/cpu", "kubernetes/overlays/multi-gpu",
            "kuberay"} <= names


def test_renders_objects_with_unique_names(rendered: list[Object]) -> None:
    assert rendered
    keys = [object_key(obj) for obj in rendered]
    assert len(keys) == len(set(keys))
    for obj in rendered:
        assert obj["apiVersion"] and obj["metadata"]["name"]


def test_matches_kubectl_kustomize(kustomization: Path, rendered: list[Object]) -> None:
    # kubectl (with kustomize built in) ships on the project's machine image; the renderer
    # above is what the other tests use, this proves it faithful.
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: cannot compare with the real kustomize")
    output = subprocess.run([kubectl, "kustomize", str(kustomization)], check=True,
                            capture_output=True, text=True, timeout=60).stdout
    real = {object_key(obj): obj for obj in yaml.safe_load_all(output) if obj}
    assert {object_key(obj): obj for obj in rendered} == real


def _deployment(**spec: object) -> Object:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
            "spec": spec}


def test_strategic_merge_rules() -> None:
    base = _deployment(template={"spec": {
        "tolerations": [{"key": "a"}],
        "containers": [{"name": "c", "args": ["--a", "1"],
                        "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]}],
        "volumes": [{"name": "v1", "emptyDir": {}}, {"name": "v2", "emptyDir": {}}],
    }})
    patch = _deployment(template={"spec": {
        "tolerations": None,
        "containers": [{"name": "c", "args": ["--b"],
                        "env": [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"}]}],
        "volumes": [{"name": "v1", "$patch": "delete"}],
    }})
    [merged] = apply_strategic_merge([base], patch)
    pod = merged["spec"]["template"]["spec"]
    assert "tolerations" not in pod
    [container] = pod["containers"]
    assert container["args"] == ["--b"]  # plain lists are replaced
    assert container["env"] == [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"},
                                {"name": "X", "value": "1"}]
    assert pod["volumes"] == [{"name": "v2", "emptyDir": {}}]


def test_patch_can_delete_an_object_and_must_match_one() -> None:
    base = _deployment()
    assert apply_strategic_merge([base], {**_deployment(), "$patch": "delete"}) == []
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "other"}}
    with pytest.raises(ValueError, match="0 objects match"):
        apply_strategic_merge([base], other)


def test_unsupported_kustomize_feature_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(UnsupportedKustomization, match="namePrefix"):
        render(tmp_path)
