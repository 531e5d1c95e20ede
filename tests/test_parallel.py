"""Parallel plans: rank maps, validation, and every plan on gloo CPU processes giving the world-1 result
with resident weights that never move and per-rank reads of the storage shard only."""
from __future__ import annotations

import io
import re

import numpy as np
import pytest
from PIL import Image as PILImage

from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.config import ModelConfig
from engine.runtime.events import Error, Image, Text
from engine.parallel.plan import PRESETS, ParallelPlan, PlanError, get_plan
from engine.runtime.request import Request
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer
from engine_drive import make_engine


def test_hybrid4_rank_maps():
    p = PRESETS["hybrid4"]
    assert [p.logical_ar_rank(r) for r in range(4)] == [0, 2, 1, 3]
    assert p.ar_group(0) == [0, 2, 1, 3]                  # the ordered-gather order
    assert [p.storage_rank(r) for r in range(4)] == [0, 1, 0, 1]     # ABAB
    assert p.tp_group(3) == [2, 3] and p.replica_group(1) == [1, 3]
    assert (p.micros, p.replicas, p.sp) == (2, 2, 2)


def test_other_plans_rank_maps():
    t = PRESETS["tp2sp2"]
    assert (t.micros, t.world // t.ar_tp) == (1, 2) and t.ar_group(2) == [2, 3] and t.ar_group(1) == [0, 1]
    c = PRESETS["tp2cfg2"]
    assert c.sp == 1 and c.replica_group(0) == [0, 2]
    h8 = PRESETS["hybrid8sp4"]
    assert h8.micros == 4 and [h8.logical_ar_rank(r) for r in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert PRESETS["hybrid8"].tp_group(5) == [4, 5, 6, 7]


@pytest.mark.parametrize("args,msg", [
    (("x", 4, 3, 4), "storage TP 3 does not divide the world size 4"),
    (("x", 4, 2, 1), "AR TP 1 is not a multiple of storage TP 2"),
    (("x", 8, 2, 8, "cfg"), "CFG-parallel needs exactly 2 replicas"),
    (("x", 4, 2, 4, "sp", "ring"), "must be 'ulysses' or 'kv_gather'"),
])
def test_plan_validation_messages(args, msg):
    with pytest.raises(PlanError, match=msg):
        ParallelPlan(*args)


def test_plan_lookup_and_model_fit(tiny):
    assert get_plan(None, 4).name == "hybrid4" and get_plan(None, 1).name == "tp1"
    with pytest.raises(PlanError, match="unknown plan"):
        get_plan("tp3")
    with pytest.raises(PlanError, match="needs 4 ranks, 2 were given"):
        get_plan("hybrid4", 2)
    raw = dict(tiny.cfg.raw, num_key_value_heads=4, num_attention_heads=8)
    with pytest.raises(PlanError, match=r"KV heads \(4\) is not divisible by 8"):
        PRESETS["tp8"].check_model(ModelConfig.from_dict(raw))
    with pytest.raises(PlanError, match="Instruct-Distil"):
        PRESETS["tp2cfg2"].check_model(ModelConfig.from_dict(dict(tiny.cfg.raw, cfg_distilled=True)))
    PRESETS["hybrid8sp4"].check_model(tiny.cfg)


def _reference_image():
    buf = io.BytesIO()
    PILImage.new("RGB", (200, 150), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


REQUESTS = [dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=3, greedy=True),
            dict(prompt="make it blue", images=[_reference_image()], bot_task="think_recaption", max_new_tokens=8,
                 steps=2, seed=3, greedy=True)]


def _outcome(events):
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors, errors
    img = next(e for e in events if isinstance(e, Image))
    text = "".join(e.delta for e in events if isinstance(e, Text))
    return text, np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64), events[-1].timings


@pytest.fixture(scope="module")
def world1(tiny):
    pipe = make_engine(tiny, preview_every=0)
    return [_outcome(list(pipe.run(Request(**kw)))) for kw in REQUESTS]


SHARDED = re.compile(r"(qkv_proj|o_proj|gate_and_up_proj|down_proj)\.weight$|^lm_head\.weight$")


def _expected_bytes(folder, storage_tp):
    ck = Checkpoint(folder)
    total = 0
    for name, info in ck.tensors.items():
        if name.startswith("vision_model.head."):
            continue
        n = int(np.prod(info.shape)) * {"F32": 4, "BF16": 2, "F16": 2}[info.dtype]
        total += n // storage_tp if SHARDED.search(name) else n
    return total


@pytest.mark.parametrize("plan,sp", [("tp2", None), ("hybrid4", "ulysses"), ("hybrid4", "kv_gather"), ("tp4", None),
                                     ("tp2sp2", "ulysses"), ("tp2sp2", "kv_gather"), ("tp2cfg2", None),
                                     ("hybrid8sp4", "ulysses")])   # 8 ranks: AR TP8 -> TP2 x SP4 (4 micros)
def test_plan_equals_world1(tiny_dir, world1, plan, sp):
    with EngineServer(EngineConfig(tiny_dir, plan=plan, sp_kind=sp, preview_every=0)) as server:
        assert server.wait_ready(300), server.health()
        results = [_outcome(list(server.stream(Request(**kw)))) for kw in REQUESTS]
        stats = server.health()["ranks"]
    assert len(stats) == get_plan(plan).world
    for (t0, img0, tm0), (t1, img1, tm1) in zip(world1, results):
        assert t1 == t0                                   # the same greedy CoT tokens
        mse = ((img0 - img1) ** 2).mean()
        assert 10 * np.log10(255 ** 2 / max(mse, 1e-12)) >= 40, f"PSNR too low ({mse=})"
        assert tm1.kv_reused_tokens == tm0.kv_reused_tokens > 0
    storage_tp = get_plan(plan).storage_tp
    full = _expected_bytes(tiny_dir, 1)
    for s in stats:
        assert s["pointers_unchanged"], s                 # before AR, at the switch to denoise, after
        assert (s["backend"], s["device"]) == ("gloo", "cpu"), s
        assert s["bytes_read"] == _expected_bytes(tiny_dir, storage_tp) < full
