"""Checkpoints made by the real tools (auto-round 0.15.0 `--model_free --device cpu`, llm-compressor 0.14.0.1
model-free PTQ), committed as small fixtures (tests/data/quant/, tools/quant_fixtures.py): our loader's
dequantized weights equal each tool's own dequantization bit for bit, our writer lays checkpoints out
exactly as the tools do, and (slow, where the tools are installed) the fixtures are what the tools
write today."""
from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from engine.model.loader import load
from engine.model.packed import dense
from engine.model.weights import FormatMismatchWarning, plan_checkpoint
from engine.checkpoint.shapes import backbone_linears
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.config import CheckpointConfig
from engine.checkpoint.qtensors import read_tensors
from engine.checkpoint.quant import WeightFormat
from tools import quant_fixtures as qf
from tools.tiny import make_tiny

CASES = list(qf.CASES)
# the fixture case each of our writer's formats reproduces
WRITER = {"autoround-mxfp8": "mxfp8", "autoround-mxfp8-llmc": "mxfp8-ct", "autoround-mxfp4": "mxfp4",
          "autoround-mxfp4-llmc": "mxfp4-ct", "llmc-nvfp4a16": "nvfp4-ct"}
FORMATS = {"autoround-mxfp8": {WeightFormat.MXFP8}, "autoround-mxfp8-llmc": {WeightFormat.MXFP8},
           "autoround-mxfp4": {WeightFormat.MXFP4, WeightFormat.MXFP8},
           "autoround-mxfp4-llmc": {WeightFormat.MXFP4, WeightFormat.MXFP8},
           "llmc-nvfp4a16": {WeightFormat.NVFP4}, "llmc-mxfp4a16": {WeightFormat.MXFP4},
           "llmc-mxfp8a16": {WeightFormat.MXFP8}}


def _planned(folder: Path):
    ck = Checkpoint(folder)
    expected, formats = plan_checkpoint(CheckpointConfig.load(folder).model, ck)
    ck.validate(expected, skipped=[n for n in ck.tensors if n.startswith("vision_model.head.")])
    ck.formats = formats
    return ck, formats


def _ours(ck: Checkpoint, formats) -> dict[str, torch.Tensor]:
    return {layer: dense(read_tensors(ck, ts), torch.bfloat16) for layer, ts in formats.items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    return {case: qf.build(case, root / case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_loader_dequantizes_like_the_tool_bitwise(built, case):
    meta = qf.fixture(case)
    ck, formats = _planned(built[case])
    assert sorted(formats) == sorted(meta["dequant_bf16_sha256"]) == sorted(backbone_linears(
        CheckpointConfig.load(built[case]).model))
    assert {ts.format for ts in formats.values()} == FORMATS[case]
    ours = _ours(ck, formats)
    bad = [layer for layer, sha in meta["dequant_bf16_sha256"].items() if qf.digest(ours[layer]) != sha]
    assert not bad, f"{len(bad)} layers differ from the tool's dequantization, first {bad[0]}"


@pytest.mark.parametrize("case", CASES)
def test_tool_checkpoints_load_without_warnings_and_close_to_bf16(built, case, tmp_path):
    ref = load(qf.source(tmp_path / "src")).model.transformer
    with warnings.catch_warnings():
        warnings.simplefilter("error", FormatMismatchWarning)
        lm = load(built[case])
    tr = lm.model.transformer
    tol = 0.12 if WeightFormat.MXFP4 in FORMATS[case] or WeightFormat.NVFP4 in FORMATS[case] else 0.03
    for name in ("layers.0.self_attn.qkv", "layers.1.self_attn.o_proj", "layers.0.mlp.w1", "layers.1.mlp.w2",
                 "layers.0.mlp.shared_w1"):
        p, p0 = tr.get_parameter(name), ref.get_parameter(name)
        assert 0 < ((p - p0).norm() / p0.norm()).item() < tol, name
    assert torch.equal(tr.lm_head, ref.lm_head) and torch.equal(tr.layers[1].mlp.gate, ref.layers[1].mlp.gate)


def test_the_cards_regex_key_reads_like_the_stock_key(built, tmp_path):
    """The card fixed auto-round's `.mlp.experts.` key into `.*mlp\\.experts` by hand; both resolve the
    experts to MXFP4 here (no warning) and load the same weights."""
    import shutil
    folder = shutil.copytree(built["autoround-mxfp4"], tmp_path / "fixed")
    cfg = json.loads((folder / "config.json").read_text())
    extra = cfg["quantization_config"]["extra_config"]
    assert list(extra)[0] == ".mlp.experts."
    cfg["quantization_config"]["extra_config"] = {".*mlp\\.experts": extra.pop(".mlp.experts."), **extra}
    (folder / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FormatMismatchWarning)
        a = load(folder).model.transformer
    b = load(built["autoround-mxfp4"]).model.transformer
    assert torch.equal(a.layers[1].mlp.w2, b.layers[1].mlp.w2)


def _layout(folder: Path) -> dict:
    ck = Checkpoint(folder)
    return {n: (i.dtype, i.shape, i.file) for n, i in ck.tensors.items()}


@pytest.mark.parametrize("case", list(WRITER))
def test_our_writer_lays_out_checkpoints_as_the_tool(built, case, tmp_path):
    ours = make_tiny(tmp_path / "ours", blocks=True, seed=qf.SEED, quant=WRITER[case])
    assert _layout(ours) == _layout(built[case])                 # names, dtypes, shapes, shard of each tensor
    cfg = lambda f: json.loads((f / "config.json").read_text())  # noqa: E731
    assert cfg(ours) == cfg(built[case])                         # incl. quantization_config, as the tool writes it
    side = lambda f: sorted(p.name for p in f.iterdir())         # noqa: E731
    assert side(ours) == side(built[case])


# ------------------------------------------------------------------ the tools themselves (slow)
def _tools_installed() -> bool:
    return all(importlib.util.find_spec(m) for m in ("auto_round", "compressed_tensors", "llmcompressor"))


@pytest.fixture(scope="module")
def tool_source(tmp_path_factory):
    return qf.source(tmp_path_factory.mktemp("tool_src") / "src")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_fixtures_are_what_the_tools_write_today(case, tool_source, built, tmp_path):
    if not _tools_installed():
        pytest.skip("auto-round / compressed-tensors / llmcompressor are not installed (README: Quantized checkpoints)")
    meta = qf.fixture(case)
    if qf.versions() != meta["tools"]:
        pytest.skip(f"installed tools {qf.versions()} differ from the fixture's {meta['tools']}")
    out = tmp_path / "out"
    qf.run_tool(case, tool_source, out)
    fresh = tmp_path / "fresh"
    qf.write_fixture(case, tool_source, out, data=fresh)
    assert json.loads((fresh / f"{case}.json").read_text()) == meta
    tensors = {n: t for n, (_, t) in qf.changed(tool_source, out).items()}
    from safetensors.torch import load_file
    committed = load_file(str(qf.DATA / meta["tensors"]))
    assert sorted(tensors) == sorted(committed) and all(qf._same(tensors[n], committed[n]) for n in tensors)
    # the rebuilt fixture folder is the tool's folder, tensor for tensor
    a, b = qf._tensors(out), qf._tensors(built[case])
    assert sorted(a) == sorted(b) and all(a[n][0] == b[n][0] and qf._same(a[n][1], b[n][1]) for n in a)
    # and our dequantization equals the tool's own, compared as tensors
    ck, formats = _planned(out)
    theirs, ours = qf.tool_dequant(out), _ours(ck, formats)
    assert sorted(theirs) == sorted(ours)
    for layer in theirs:
        assert torch.equal(ours[layer], theirs[layer]), layer
