"""The embedded default model (assets/model) through the real pipeline, on a small held-out sample:
floors that a broken sampler, mask, cache or tokenizer would fall through. The full evaluation and its
numbers are in README.md (`python -m train.evaluate --model assets/model --n 40 --n-edit 40`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from train.evaluate import evaluate

MODEL = Path(__file__).resolve().parents[1] / "assets" / "model"
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="no embedded model in assets/")


def test_embedded_model_floor():
    # Measured on this sample (2026-11-29, CPU, 16 steps): well-formed 100%, CoT correct 100%, T2I
    # attributes 85% (colour 100%), edits 4/4. A broken sampler, mask or cache loses the colours first
    # (random-init or mismatched-sequence models score ~15% colour); the floors leave room for float
    # differences between machines (a few objects).
    m = evaluate(MODEL, n=8, n_edit=4, seed=0, threads=None, log=lambda *a: None)
    assert m["reasoning_well_formed"] >= 0.85, m
    assert m["t2i_cot_correct"] >= 0.85, m
    assert m["t2i_color"] >= 0.85, m
    assert m["t2i_attribute_accuracy"] >= 0.65, m
    assert m["ti2i_edit_accuracy"] >= 0.75, m
