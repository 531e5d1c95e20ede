"""The embedded default model (assets/model) through the real pipeline, on a small held-out sample:
floors that a broken sampler, mask, cache or tokenizer would fall through. The full evaluation and its
numbers are in README.md (`python -m train.evaluate --model assets/model --n 24 --n-edit 24`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from train.evaluate import evaluate

MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="no embedded model in assets/")


def test_embedded_model_floor():
    m = evaluate(MODEL, n=4, n_edit=2, seed=0, threads=None, log=lambda *a: None)
    assert m["reasoning_well_formed"] >= 0.75, m
    assert m["t2i_attribute_accuracy"] >= 0.10, m
    assert m["t2i_color"] >= 0.30, m
