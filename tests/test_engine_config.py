"""EngineConfig, the engine's one configuration: every option is one field whose flag both command lines
carry, read back into the same value, checked once (__post_init__) whichever way it came."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

import app
from engine.__main__ import _parser as engine_cli
from engine.__main__ import main as engine_main
from engine.serve.engine_config import SERVING_MAX_BATCH, EngineConfig, option
from engine.serve.info import ModelInfo

ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--plan", "tp1", "--sp-attn", "kv_gather",
                "--max-batch", "3", "--max-denoise-batch", "2", "--preview-every", "0", "--cfg-serial",
                "--no-cuda-graph", "--max-loras", "2", "--max-lora-rank", "16", "--lora-mlp",
                "--prefix-cache-mb", "64", "--encoding-cache-mb", "32", "--warmup", "1024x1024, 768x1280"]


def test_both_command_lines_make_the_same_config_from_the_same_flags():
    studio = app.parse_args(ENGINE_FLAGS).engine
    one_shot = EngineConfig.from_args(engine_cli().parse_args(["generate", "--prompt", "x", "--out", "o.png",
                                                              *ENGINE_FLAGS]))
    assert studio == one_shot
    assert (studio.max_batch, studio.cuda_graph, studio.warmup, studio.sp_kind) == (
        3, False, ("1024x1024", "768x1280"), "kv_gather")


def test_every_option_is_a_flag_of_both_command_lines(capsys):
    flags = [f.metadata["flag"] or "--" + f.name.replace("_", "-") for f in fields(EngineConfig)
             if f.metadata.get("flag") is not None]
    assert len(flags) == len(fields(EngineConfig)) - 1                   # all but verbose
    for parse in (app.parse_args, lambda argv: engine_cli().parse_args(["text", *argv])):
        with pytest.raises(SystemExit):
            parse(["--help"])
        shown = capsys.readouterr().out
        assert [f for f in flags if f not in shown] == []


def test_each_command_line_keeps_its_own_batch_default():
    assert app.parse_args([]).engine.max_batch == SERVING_MAX_BATCH
    assert EngineConfig.from_args(engine_cli().parse_args(["text", "--prompt", "x"])).max_batch == 1


def test_a_new_option_is_one_field():
    """A field with its option(...) is a flag on any parser add_arguments builds and a value from_args
    reads: nothing else passes it along."""
    @dataclass(frozen=True)
    class WithThreads(EngineConfig):
        threads: int = option(4, "CPU threads a rank uses", type=int)

    ap = argparse.ArgumentParser()
    WithThreads.add_arguments(ap)
    assert "CPU threads a rank uses (default 4)" in ap.format_help()
    assert WithThreads.from_args(ap.parse_args(["--threads", "3"])).threads == 3
    assert WithThreads.from_args(ap.parse_args([])).threads == 4


@pytest.mark.parametrize("argv, words", [
    (["--max-batch", "0"], "max_batch must be >= 1 (got 0)"),
    (["--gpus", "0"], "world_size (--gpus) must be >= 1"),
    (["--prefix-cache-mb", "-1"], "prefix_cache_mb must be >= 0"),
    (["--lora-mlp"], "--lora-mlp sizes adapter slots"),
    (["--lora", "a=/x", "--lora", "b=/y", "--lora-merged"], "--lora-merged folds one LoRA adapter"),
    (["--lora", "a=/x", "--lora", "a=/y"], "two LoRA adapters share a name"),
    (["--warmup", " , "], "--warmup takes sizes"),
])
def test_a_bad_value_is_refused_once_for_every_way_in(argv, words, capsys):
    with pytest.raises(SystemExit):
        app.parse_args(argv)
    assert words in capsys.readouterr().err
    assert engine_main(["text", "--prompt", "x", *argv]) == 2
    assert words in capsys.readouterr().err


def test_the_same_checks_hold_for_a_config_made_in_code():
    with pytest.raises(ValueError, match="max_denoise_batch must be >= 1"):
        EngineConfig("m", max_denoise_batch=0)
    with pytest.raises(ValueError, match="unknown quantize 'int8'"):
        EngineConfig("m", quantize="int8")
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        EngineConfig("m", dtype="float8")


def test_lora_flags_take_a_name_or_the_folders():
    assert app.parse_args(["--lora", "style=/a/b", "--lora", "/c/my-adapter"]).engine.loras == (
        ("style", "/a/b"), ("my-adapter", "/c/my-adapter"))


def test_fixed_for_this_machine_and_the_checkpoint(tiny_dir, monkeypatch):
    monkeypatch.chdir(Path(tiny_dir).parent)
    asked = EngineConfig(Path(tiny_dir).name, device="cpu", world_size=2)
    fixed = asked.on_this_machine().for_checkpoint(ModelInfo.from_folder(tiny_dir))
    assert (fixed.plan, fixed.world_size, fixed.sp_kind, fixed.device) == ("tp2", 2, "ulysses", "cpu")
    assert fixed.model == str(Path(tiny_dir).resolve())
    with pytest.raises(ValueError, match="not understood"):
        EngineConfig(tiny_dir, warmup=("huge",)).for_checkpoint(ModelInfo.from_folder(tiny_dir))
    # overlap's two streams on several GPUs: refused before anything is spawned (one GPU and gloo ranks keep it)
    info = ModelInfo.from_folder(tiny_dir)
    with pytest.raises(ValueError, match="--step-policy overlap runs on one GPU: on 2 GPUs"):
        EngineConfig(tiny_dir, device="cuda", world_size=2, step_policy="overlap").with_plan().for_checkpoint(info)
    EngineConfig(tiny_dir, device="cuda", world_size=1, step_policy="overlap").with_plan().for_checkpoint(info)
    EngineConfig(tiny_dir, device="cpu", world_size=2, step_policy="overlap").with_plan().for_checkpoint(info)
    # no policy asked: auto (the engine's choice by plan and device) passes everywhere
    assert EngineConfig(tiny_dir).step_policy == "auto"
    EngineConfig(tiny_dir, device="cuda", world_size=2).with_plan().for_checkpoint(info)
    # a named kernel family of quantized packs on the CPU (which dequantizes them at load): refused, saying why
    for kw, words in ((dict(moe_kernels="humming-fp8"), "--moe-kernels humming-fp8 runs on a Hopper GPU"),
                      (dict(mxfp8_kernels="fp8"), "--mxfp8-kernels fp8 runs on a CUDA GPU")):
        with pytest.raises(ValueError, match=words):
            EngineConfig(tiny_dir, device="cpu", **kw).with_plan().for_checkpoint(info)
    EngineConfig(tiny_dir, device="cpu", moe_kernels="triton", mxfp8_kernels="auto").with_plan().for_checkpoint(info)
