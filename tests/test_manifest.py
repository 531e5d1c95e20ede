"""The loader plan, derived from the released config alone, names every tensor of the real Instruct and
Instruct-Distil checkpoints with its exact shape (the manifest was built from the official classes)."""
from __future__ import annotations

import json

import pytest

from engine.checkpoint.config import ModelConfig
from engine.model.weights import SKIPPED_PREFIXES, checkpoint_shapes, vit_head_shapes

from conftest import BASE_CONFIG, MANIFEST



def real_config(distil: bool) -> ModelConfig:
    d = json.loads(BASE_CONFIG.read_text())
    d |= {"model_version": "HunyuanImage-3.0-Instruct", "cfg_distilled": distil, "use_meanflow": distil}
    return ModelConfig.from_dict(d)


@pytest.mark.parametrize("variant,distil", [("instruct", False), ("instruct_distil", True)])
def test_plan_equals_manifest(variant, distil):
    manifest = {k: tuple(v) for k, v in json.loads(MANIFEST.read_text())[variant]["shapes"].items()}
    cfg = real_config(distil)
    plan = checkpoint_shapes(cfg)
    skipped = {k for k in manifest if k.startswith(SKIPPED_PREFIXES)}
    missing = sorted(set(manifest) - set(plan) - skipped)
    extra = sorted(set(plan) - set(manifest))
    assert not missing, f"real tensors the plan does not load: {missing[:10]}"
    assert not extra, f"tensors the plan expects that the real model lacks: {extra[:10]}"
    wrong = {k: (plan[k], manifest[k]) for k in plan if plan[k] != manifest[k]}
    assert not wrong, f"shape mismatches: {list(wrong.items())[:10]}"
    # the skipped SigLIP2 head is exactly what the tiny maker writes for it
    assert vit_head_shapes(cfg) == {k: manifest[k] for k in skipped}
    assert sum(1 for k in manifest if k.startswith("vae.")) == 280
