"""Fixtures of the deploy tests: manifests rendered offline by tests/deploy/kustomize.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.helpers import KUSTOMIZATIONS, Object, kustomization_id
from tests.deploy.kustomize import render


@pytest.fixture(params=KUSTOMIZATIONS, ids=kustomization_id)
def kustomization(request: pytest.FixtureRequest) -> Path:
    return request.param


@pytest.fixture
def rendered(kustomization: Path) -> list[Object]:
    return render(kustomization)


# The kustomizations that deploy the server as a Deployment (not the KubeRay one).
SERVER_KUSTOMIZATIONS = [
    path for path in KUSTOMIZATIONS
    if any(obj["kind"] == "Deployment" for obj in render(path))
]


@pytest.fixture(params=SERVER_KUSTOMIZATIONS, ids=kustomization_id)
def server(request: pytest.FixtureRequest) -> list[Object]:
    """The rendered objects of one kustomization that holds the server's Deployment."""
    return render(request.param)
