"""Checkpoint reading and validation: a folder that does not match its config fails at load, naming the
tensor and its file, before anything is read."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint.shards import Checkpoint, CheckpointError
from engine.model.loader import load
from engine.model.weights import checkpoint_shapes


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _shard_of(folder, name):
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][name]


def _edit_shard(folder, name, fn):
    file = folder / _shard_of(folder, name)
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file))
    return file.name


def test_lazy_slices_and_header_dtypes(tiny_dir):
    ck = Checkpoint(tiny_dir)
    info = ck.info("model.layers.0.mlp.gate.wg.weight")
    assert info.dtype == "F32" and ck.info("model.wte.weight").dtype == "BF16"
    full = ck.read("lm_head.weight")
    part = ck.read("lm_head.weight", (slice(64, 128),))
    assert torch.equal(part, full[64:128])
    assert ck.bytes_read == (full.numel() + part.numel()) * 2


@pytest.mark.parametrize("case", ["missing", "extra", "shape"])
def test_mismatch_names_tensor_and_file(tiny_dir, tmp_path, case):
    folder = _copy(tiny_dir, tmp_path / "ck")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    if case == "missing":
        file = _edit_shard(folder, name, lambda t: t.pop(name))
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        del index["weight_map"][name]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        match = f"missing tensor '{name}'"
    elif case == "extra":
        file = _edit_shard(folder, name, lambda t: t.__setitem__("model.layers.1.mlp.bogus", torch.zeros(2)))
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.layers.1.mlp.bogus"] = file
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        match = f"unexpected tensor 'model.layers.1.mlp.bogus' in {file}"
    else:
        file = _edit_shard(folder, name, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
        match = f"'{name}' in {file} has shape"
    with pytest.raises(CheckpointError, match=match):
        load(folder)


def test_index_pointing_at_missing_shard(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "ck")
    victim = _shard_of(folder, "lm_head.weight")
    (folder / victim).unlink()
    with pytest.raises(CheckpointError, match=f"shard {victim} is missing"):
        Checkpoint(folder)


def test_validation_happens_before_any_read(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "ck")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 3          # a config that promises a layer the shards lack
    cfg["moe_topk"] += [2]; cfg["moe_intermediate_size"] += [32]; cfg["num_shared_expert"] += [1]
    (folder / "config.json").write_text(json.dumps(cfg))
    ck = Checkpoint(folder)
    from engine.checkpoint.config import ModelConfig
    with pytest.raises(CheckpointError, match="model.layers.2"):
        ck.validate(checkpoint_shapes(ModelConfig.from_dict(cfg)))
    assert ck.bytes_read == 0


def test_single_file_checkpoint_loads_the_same(tiny_dir, tmp_path, tiny):
    folder = tmp_path / "single"
    folder.mkdir()
    for f in tiny_dir.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, folder / f.name)
    merged = {}
    for f in sorted(tiny_dir.glob("model-*.safetensors")):
        merged |= load_file(str(f))
    save_file(merged, str(folder / "model.safetensors"))
    lm = load(folder)
    a = dict(lm.model.named_parameters())
    for k, v in tiny.model.named_parameters():
        assert torch.equal(a[k], v), k


def test_unsupported_dtype_is_refused(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "ck")
    name = "model.ln_f.weight"
    file = _edit_shard(folder, name, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError, match=f"'{name}' in {file} has unsupported dtype F8_E4M3"):
        load(folder)
