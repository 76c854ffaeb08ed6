"""Session fixtures of the deployment tests: the parsed compose file and the
rendered overlays, each read once (see manifests.py for the shapes)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.manifests import OVERLAYS, load_compose, Container, compose_containers, k8s_containers, render_overlay


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """overlay name -> the objects `kubectl kustomize` renders for it."""
    return {overlay: render_overlay(overlay) for overlay in OVERLAYS}


@pytest.fixture(scope="session")
def k8s(rendered) -> list[Container]:
    return [c for overlay, objects in rendered.items() for c in k8s_containers(overlay, objects)]


@pytest.fixture(scope="session")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="session")
def composed(compose) -> list[Container]:
    """The Flywheel containers of docker-compose.yml (every profile)."""
    return compose_containers(compose)
