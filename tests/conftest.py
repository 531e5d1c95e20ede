"""Shared fixtures: tiny checkpoints in the official layout, made once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.model.loader import load
from tools.tiny import make_tiny

# the real models' tensor names and shapes and the released base config (copied from the workplace's
# shared/reference, so that no test depends on a folder outside the repository)
REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
MANIFEST = REFERENCE / "hunyuan_image3_manifest.json"
BASE_CONFIG = REFERENCE / "base_config_reference.json"

# pytest-xdist's workers share the machine's cores: each worker's torch, and every process its tests start
# (they inherit OMP_NUM_THREADS), takes cores / workers threads. torch's default (every core, in every
# worker) oversubscribes them, and OpenMP's spinning threads then wait on one another: two workers of
# tests/test_image_phase.py on this project's 2-core machine (a third job running beside them) took 158 s that
# way and 74 s on one thread each.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
