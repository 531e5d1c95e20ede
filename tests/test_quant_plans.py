"""Quantized checkpoints on every parallel plan: each rank's storage shard of every format, read in its
format and dequantized, equals the same shard of the dequantized (float) checkpoint, with each rank
reading only its bytes; and a tool-made MXFP4-mixed checkpoint runs a request on a gloo plan with the
tp1 result."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from safetensors.torch import load_file, save_file

from engine.model.packed import dense
from engine.model.transformer import Transformer
from engine.model.weights import SKIPPED_PREFIXES, plan_checkpoint
from engine.checkpoint.shapes import backbone_linears
from engine.parallel.plan import PRESETS, get_plan
from engine.runtime.events import Error, Image, Text
from engine.runtime.request import Request
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer
from engine.model.loader import load
from engine.checkpoint import names
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.config import CheckpointConfig
from engine.checkpoint.qtensors import read_tensors
from tools import quant_fixtures as qf
from tools.tiny import make_tiny
from tools.tiny_quant import QUANT_FORMATS
from engine_drive import make_engine

LAYOUTS = sorted({p.layout(r) for p in PRESETS.values() for r in range(p.world)},
                 key=lambda l: (l.storage_size, l.micros, l.storage_rank))
BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}


def _dequantized_twin(folder, out):
    """The same checkpoint with every quantized layer replaced by its float32 dequantization."""
    shutil.copytree(folder, out)
    ck = Checkpoint(folder)
    cc = CheckpointConfig.load(folder)
    _, formats = plan_checkpoint(cc.model, ck)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        t = load_file(str(out / file))
        for layer, ts in formats.items():
            if f"{layer}.{ts.codes}" in t:
                for n in [n for n in t if n.rpartition(".")[0] == layer]:
                    del t[n]
                t[layer + ".weight"] = dense(read_tensors(ck, ts), torch.float32)
        save_file(t, str(out / file))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file} | {n: file for n in t}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    for side in ("quantization_config.json", "hf_quant_config.json"):
        (out / side).unlink(missing_ok=True)
    return out


def _backbone(folder, layout):
    """The backbone as one rank of `layout` loads it (the image-side modules are replicated and untouched)."""
    cc, ck = CheckpointConfig.load(folder), Checkpoint(folder)
    expected, formats = plan_checkpoint(cc.model, ck, layout)
    ck.validate(expected, skipped=[n for n in ck.tensors if n.startswith(SKIPPED_PREFIXES)])
    ck.formats = formats
    tr = Transformer(cc.model, layout)
    with torch.no_grad():
        tr.load_ends(ck, layout)
        for i, layer in enumerate(tr.layers):
            layer.load(ck, names.layer(i), layout)
    return tr, ck.bytes_read


def _expected_bytes(folder, storage, image_side=False):
    """Bytes one rank reads for the backbone (and the replicated image side): codes and block scales 1/storage,
    per-channel scales 1/storage for row-split layers and whole for K-split ones, scalars whole,
    activation scales never."""
    ck, cfg = Checkpoint(folder), CheckpointConfig.load(folder).model
    linears = backbone_linears(cfg)
    _, formats = plan_checkpoint(cfg, ck)
    total = 0
    for name, info in ck.tensors.items():
        n = int(np.prod(info.shape, dtype=np.int64)) * BYTES[info.dtype]
        layer, _, leaf = name.rpartition(".")
        ts = formats.get(layer)
        if not name.startswith(("model.", "lm_head.")):
            total += n if image_side and not name.startswith(SKIPPED_PREFIXES) else 0
        elif leaf.startswith("input_"):
            continue
        elif name == "lm_head.weight" or (layer in linears and leaf == (ts.codes if ts else "weight")):
            total += n // storage
        elif ts and leaf == ts.scales and (ts.format.block or (ts.format.value == "fp8-channel"
                                                               and linears[layer][2] is None)):
            total += n // storage
        else:
            total += n
    return total


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plans")
    out = {}
    for fmt in QUANT_FORMATS:
        q = make_tiny(root / fmt, blocks=True, quant=fmt)
        out[fmt] = (q, _dequantized_twin(q, root / f"{fmt}-float"))
    return out


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_every_plan_reads_its_shard_of_every_format(pairs, fmt):
    quant, twin = pairs[fmt]
    for layout in LAYOUTS:
        a, read = _backbone(quant, layout)
        b, _ = _backbone(twin, layout)
        for (name, p), (_, p0) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(p, p0), (fmt, layout, name)
        assert read == _expected_bytes(quant, layout.storage_size), (fmt, layout)


def _outcome(events):
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors, errors
    img = next(e for e in events if isinstance(e, Image))
    text = "".join(e.delta for e in events if isinstance(e, Text))
    return text, np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64)


@pytest.mark.slow
def test_tool_made_mxfp4_runs_on_hybrid4_like_tp1(tmp_path):
    folder = qf.build("autoround-mxfp4", tmp_path / "mxfp4")
    req = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=3, greedy=True)
    text0, img0 = _outcome(list(make_engine(load(folder), preview_every=0).run(Request(**req))))
    with EngineServer(EngineConfig(folder, plan="hybrid4", preview_every=0)) as server:
        assert server.wait_ready(300), server.health()
        text1, img1 = _outcome(list(server.stream(Request(**req))))
        stats = server.health()["ranks"]
    assert text1 == text0 and len(text0) > 0
    mse = ((img0 - img1) ** 2).mean()
    assert 10 * np.log10(255 ** 2 / max(mse, 1e-12)) >= 40, f"PSNR too low ({mse=})"
    assert len(stats) == get_plan("hybrid4").world
    assert all(s["pointers_unchanged"] and s["backend"] == "gloo" for s in stats)
    # each rank reads its half of the split tensors (codes and block scales) and the whole of the rest
    for s in stats:
        assert s["bytes_read"] == _expected_bytes(folder, 2, image_side=True) < _expected_bytes(folder, 1, True)
