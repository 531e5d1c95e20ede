"""Which plan fits the GPUs: per-rank memory estimated from the checkpoint's headers and config, before
anything is loaded (engine/parallel/fit.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MANIFEST
from engine.parallel.fit import GIB, choose_plan, estimate
from engine.parallel.plan import PRESETS, PlanError
from engine.checkpoint.shards import Checkpoint, TensorInfo
from engine.checkpoint.config import CheckpointConfig, GenerationConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_weights_split_over_the_storage_shards(tiny_dir):
    ckpt, cc = Checkpoint(tiny_dir), CheckpointConfig.load(tiny_dir)
    one = estimate(ckpt, cc, PRESETS["tp1"], working=0)
    two = estimate(ckpt, cc, PRESETS["tp2"], working=0)
    hybrid = estimate(ckpt, cc, PRESETS["hybrid4"], working=0)
    assert two.weights < one.weights and hybrid.weights == two.weights      # hybrid4 keeps TP2 shards
    assert two.kv_cache * 2 == one.kv_cache


def test_the_fewest_gpus_that_fit_and_a_clear_refusal(tiny_dir):
    ckpt, cc = Checkpoint(tiny_dir), CheckpointConfig.load(tiny_dir)
    one = estimate(ckpt, cc, PRESETS["tp1"], working=0).total
    two = estimate(ckpt, cc, PRESETS["tp2"], working=0).total
    plan, _ = choose_plan(ckpt, cc, 4, one, working=0)
    assert plan.name == "tp1"
    plan, _ = choose_plan(ckpt, cc, 4, (one + two) // 2, working=0)
    assert plan.name == "tp2"
    with pytest.raises(PlanError, match=r"does not fit 1 GPU\(s\).*tp1: .* GiB per GPU"):
        choose_plan(ckpt, cc, 1, two, working=0)


def test_the_conversation_caches_count_per_rank(tiny_dir):
    """The server's prefix and encoding caches fill up to their bounds on every rank: a GPU that holds tp1
    without them needs tp2 with them, and the refusal names them."""
    ckpt, cc = Checkpoint(tiny_dir), CheckpointConfig.load(tiny_dir)
    one = estimate(ckpt, cc, PRESETS["tp1"], working=0)
    caches = 3 * GIB
    assert estimate(ckpt, cc, PRESETS["tp1"], working=0, caches=caches).total == one.total + caches
    two = estimate(ckpt, cc, PRESETS["tp2"], working=0, caches=caches)
    assert choose_plan(ckpt, cc, 4, one.total, working=0)[0].name == "tp1"
    assert choose_plan(ckpt, cc, 4, two.total, working=0, caches=caches)[0].name == "tp2"
    with pytest.raises(PlanError, match=r"3 GiB conversation caches"):
        choose_plan(ckpt, cc, 1, one.total, working=0, caches=caches)


class _Headers:
    """The real model's tensors as a checkpoint's headers would list them (no data)."""

    def __init__(self, shapes: dict, dtype: str = "BF16"):
        self.tensors = {n: TensorInfo(n, tuple(s), dtype, "x") for n, s in shapes.items()}


def test_the_real_instruct_model_in_bf16_needs_two_h200_and_fp8_fits_one():
    shapes = json.loads(MANIFEST.read_text())["instruct"]["shapes"]
    cfg = ModelConfig.from_dict(json.loads((ROOT / "bench" / "instruct_config.json").read_text()))
    cc = CheckpointConfig(cfg, GenerationConfig())
    ckpt = _Headers(shapes)
    h200 = 139 * GIB
    one = estimate(ckpt, cc, PRESETS["tp1"])
    assert 150 * GIB < one.weights < 175 * GIB            # ~80B parameters in bf16
    plan, est = choose_plan(ckpt, cc, 4, h200)
    assert plan.name == "tp2" and est.total < h200
    plan, est = choose_plan(ckpt, cc, 1, h200, quantize="fp8")
    assert plan.name == "tp1" and est.weights < 90 * GIB
