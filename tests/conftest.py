"""Shared fixtures: tiny checkpoints in the official layout, made once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.loader import load
from tools.tiny import make_tiny

# the real models' tensor names and shapes and the released base config (copied from the workplace's
# shared/reference, so that no test depends on a folder outside the repository)
REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
MANIFEST = REFERENCE / "hunyuan_image3_manifest.json"
BASE_CONFIG = REFERENCE / "base_config_reference.json"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "instruct", seed=0)


@pytest.fixture(scope="session")
def tiny_distil_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "distil", distil=True, seed=1)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return load(tiny_dir)


@pytest.fixture(scope="session")
def tiny_distil(tiny_distil_dir):
    return load(tiny_distil_dir)
