"""Session-wide fixture models and a fresh model store per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.model_store import LocalModelStore
from serving.model import LoadedModel
from tests.serving.fixture_model import MODEL_NAME, OLD_VERSION, WEIGHTS, export_fixture_model


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each fixture version exported once per session: version -> model directory."""
    root = tmp_path_factory.mktemp("exported")
    return {version: export_fixture_model(root / version, version) for version in WEIGHTS}


@pytest.fixture(scope="session")
def old_model(exported: dict[str, Path]) -> LoadedModel:
    return LoadedModel.load(exported[OLD_VERSION], OLD_VERSION)


@pytest.fixture
def store(tmp_path: Path, exported: dict[str, Path]) -> LocalModelStore:
    """A fresh local model store holding the old version."""
    store = LocalModelStore(tmp_path / "store")
    store.publish(MODEL_NAME, OLD_VERSION, exported[OLD_VERSION])
    return store
