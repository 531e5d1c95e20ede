"""Config parsing, Instruct vs Distil detection, resolution buckets and size strings."""
from __future__ import annotations

import json

import pytest

from engine.checkpoint.buckets import SizeError, build_buckets, parse_size
from engine.checkpoint.config import CheckpointConfig, ConfigError, GenerationConfig, ModelConfig

from conftest import BASE_CONFIG as BASE



def test_released_config_defaults():
    cfg = ModelConfig.from_dict(json.loads(BASE.read_text()))
    assert (cfg.patch_size, cfg.patch_embed_hidden_dim, cfg.image_base_size) == (1, 1024, 1024)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads) == (32, 8, 128, 4)
    assert cfg.num_experts == (64,) * 32 and cfg.moe_topk == (8,) * 32
    assert cfg.shared_intermediate(0) == 3072
    assert not cfg.cfg_distilled and cfg.cond_token_attn_type == "joint_full"


def test_distil_detection_and_generation_defaults(tiny_dir, tiny_distil_dir):
    a, b = CheckpointConfig.load(tiny_dir), CheckpointConfig.load(tiny_distil_dir)
    assert not a.model.cfg_distilled and b.model.cfg_distilled and b.model.use_meanflow
    assert (a.generation.diff_infer_steps, a.generation.diff_guidance_scale) == (50, 5.0)
    assert (b.generation.diff_infer_steps, b.generation.diff_guidance_scale) == (8, 2.5)
    # keys missing from a generation config fall back per variant
    assert GenerationConfig.from_dict({}, distil=True).diff_infer_steps == 8
    assert GenerationConfig.from_dict({}, distil=False).diff_guidance_scale == 5.0


def test_unreadable_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        CheckpointConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        CheckpointConfig.load(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        CheckpointConfig.load(tmp_path / "nope")


def test_official_bucket_table():
    b = build_buckets(1024)
    assert len(b) == 37
    hw = [(x.height, x.width) for x in b]
    assert hw[0] == (512, 2048) and hw[8] == (512, 1536) and hw[9] == (576, 1472) and hw[15] == (960, 1088)
    assert hw[16] == (1024, 1024) and hw[17] == (1088, 960) and hw[32] == (2048, 512)
    assert hw[33:] == [(1024, 768), (1280, 720), (768, 1024), (720, 1280)]
    assert b[34].token == "<img_ratio_34>"
    ratios = [x.ratio for x in b[:33]]
    assert ratios == sorted(ratios)


def test_size_strings():
    b = build_buckets(1024)
    assert parse_size("auto", b) is None
    assert parse_size("1344x768", b).index == 34          # HxW, nearest ratio -> 1280x720
    assert parse_size("16:9", b).index == 36              # W:H: landscape -> 720x1280 (HxW)
    assert parse_size("9:16", b).index == 34
    assert parse_size("1024x1024", b).index == 16
    assert parse_size("<img_ratio_3>", b).index == 3
    for bad in ("big", "0x100", "<img_ratio_40>", "12x", ""):
        with pytest.raises(SizeError):
            parse_size(bad, b)
