"""A small kustomize renderer for the features deploy/ uses, so the tests run offline.

Supported in ``kustomization.yaml``: ``resources`` (files and folders with their own
kustomization), ``labels`` (added to ``metadata.labels`` only: ``includeSelectors`` and
``includeTemplates`` must stay off), ``images`` (``newName`` / ``newTag`` for every
``containers[]`` / ``initContainers[]`` image) and ``patches`` given by ``path`` holding
a strategic-merge patch whose kind and name pick the target. Any other field raises, so a
kustomization cannot silently use a feature this renderer would get wrong.
``test_matches_kubectl_kustomize`` compares the result with the real kustomize.

Strategic-merge rules implemented (the Kubernetes ones for these fields): maps merge
recursively, ``null`` deletes a field, lists of containers / env / volumes merge by
``name`` and volumeMounts by ``mountPath`` (``$patch: delete`` on an item removes it; the
items a patch names come first, as kustomize orders them), every other list is replaced
whole; ``$patch: delete`` at the top of a patch removes the object.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "labels", "images", "patches"}

# Field name -> merge key of the list under it (Kubernetes' patchMergeKey for pod specs).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def load_yaml_documents(path: Path) -> list[Object]:
    """Every non-empty YAML document of ``path``."""
    with path.open() as stream:
        return [doc for doc in yaml.safe_load_all(stream) if doc]


def object_key(obj: Object) -> tuple[str, str]:
    """``(kind, name)``: how patches find their target and how outputs are compared."""
    return obj["kind"], obj["metadata"]["name"]


def render(directory: Path) -> list[Object]:
    """The objects ``kustomize build directory`` would print (order not significant)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_FIELDS
    if unknown:
        raise UnsupportedKustomization(f"{directory}: unsupported fields {sorted(unknown)}")

    objects: list[Object] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        objects += render(path) if path.is_dir() else load_yaml_documents(path)
    keys = [object_key(obj) for obj in objects]
    if len(keys) != len(set(keys)):
        raise ValueError(f"{directory}: duplicate objects {sorted(keys)}")

    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise UnsupportedKustomization(f"{directory}: patch {patch_entry} (only `path`)")
        for patch in load_yaml_documents(directory / patch_entry["path"]):
            objects = apply_strategic_merge(objects, patch)

    for label_set in kustomization.get("labels", []):
        if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
            raise UnsupportedKustomization(f"{directory}: labels beyond metadata")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label_set["pairs"])

    for image in kustomization.get("images", []):
        if set(image) - {"name", "newName", "newTag"}:
            raise UnsupportedKustomization(f"{directory}: image {image}")
        for obj in objects:
            _set_images(obj, image)
    return objects


def apply_strategic_merge(objects: list[Object], patch: Object) -> list[Object]:
    """``objects`` with ``patch`` applied to the object of the same kind and name."""
    target = object_key(patch)
    matches = [obj for obj in objects if object_key(obj) == target]
    if len(matches) != 1:
        raise ValueError(f"patch target {target}: {len(matches)} objects match")
    if patch.get("$patch") == "delete":
        return [obj for obj in objects if object_key(obj) != target]
    merged = merge_maps(matches[0], patch)
    return [merged if object_key(obj) == target else obj for obj in objects]


def merge_maps(original: Object, patch: Object) -> Object:
    """Strategic merge of two maps (see the module docstring for the rules)."""
    result = copy.deepcopy(original)
    for key, value in patch.items():
        if key == "$patch":
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge_maps(result[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and key in result:
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = _without_directives(copy.deepcopy(value))
    return result


def _merge_list(original: list[Object], patch: list[Object], merge_key: str) -> list[Object]:
    # Like kustomize (kyaml): the items the patch names come first, in the patch's order,
    # then the other original items in their order.
    by_key = {item[merge_key]: item for item in original}
    named = [item[merge_key] for item in patch]
    result = []
    for item in patch:
        if item.get("$patch") == "delete":
            continue
        old = by_key.get(item[merge_key])
        result.append(merge_maps(old, item) if old is not None
                      else _without_directives(copy.deepcopy(item)))
    result += [copy.deepcopy(item) for item in original if item[merge_key] not in named]
    return result


def _without_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if k != "$patch"}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return value


def _set_images(node: Any, image: dict[str, str]) -> None:
    """Rewrite every container image named ``image["name"]`` (with or without a tag)."""
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for container in value:
                name, _, tag = container.get("image", "").partition(":")
                if name == image["name"]:
                    new_tag = image.get("newTag", tag)
                    new_name = image.get("newName", name)
                    container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name
        _set_images(value, image)
