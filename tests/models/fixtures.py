"""Fixtures shared by the model tests (tests/conftest.py offers them to the whole suite):
tiny random HF folders, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny import MOE_SPECS, SPECS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model(tiny_root: Path):
    """tiny_model(name) -> folder of SPECS[name] (or MOE_SPECS[name]), built on first use."""
    def get(name: str) -> Path:
        return build_tiny_model(SPECS[name] if name in SPECS else MOE_SPECS[name], tiny_root)
    return get
