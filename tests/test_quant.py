"""Quantized weights: the exact dequantization references (nibble order, E8M0, NVFP4 in both conventions,
FP8), the formats each config declares, the loader's checks (tensors win over the config, unsupported
formats and plans that cut a block are refused before anything is read), and every format our writer
lays out loading to its dequantized weights."""
from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hunyuan_kernels as kernels
import hunyuan_kernels.quant as kq
from engine.model.loader import load
from engine.model.packed import dense, read_rows
from engine.model.weights import FormatMismatchWarning, plan_checkpoint
from engine.checkpoint.shapes import backbone_linears
from engine.parallel.layout import ShardLayout
from engine.checkpoint.shards import Checkpoint, CheckpointError
from engine.checkpoint.config import CheckpointConfig
from engine.checkpoint.quant import QuantScheme, WeightFormat
from tools.tiny import make_tiny
from tools.tiny_quant import QUANT_FORMATS, quantize_mx, quantize_nvfp4

W = WeightFormat


# ------------------------------------------------------------------ kernels
def test_e2m1_nibbles_low_is_even_column_and_e8m0_bias():
    # byte 0x21: column 0 = code 1 (0.5), column 1 = code 2 (1.0); 0xF9: code 9 (-0.5), code 15 (-6)
    packed = torch.tensor([[0x21, 0xF9] + [0] * 14], dtype=torch.uint8)
    out = kernels.call("dequant_mxfp4", packed, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert out[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0] and out.shape == (1, 32)
    e = kq.e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert e[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127] and torch.isnan(e[6])
    assert torch.equal(kq.unpack_fp4(kq.pack_fp4(torch.arange(16, dtype=torch.uint8).view(1, 16))),
                       torch.arange(16, dtype=torch.uint8).view(1, 16))


def test_mx_roundtrip_is_exact_and_blockwise():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g) * torch.logspace(-3, 2, 64)      # blocks of very different scales
    # OCP MX scales (2^(floor(log2 amax) - emax)) saturate the block maximum: up to 1/8 (E4M3 at 448) and
    # 1/4 (E2M1 at 6) of the block amax, plus rounding
    for bits, tol in ((8, 0.13), (4, 0.3)):
        codes, scales = quantize_mx(w, bits)
        op = "dequant_mxfp8" if bits == 8 else "dequant_mxfp4"
        d32, d16 = kernels.call(op, codes, scales, torch.float32), kernels.call(op, codes, scales, torch.bfloat16)
        assert torch.equal(d32.to(torch.bfloat16), d16)                  # exact in fp32 -> one rounding
        err = (d32 - w).abs() / w.abs().unflatten(-1, (2, 32)).amax(-1).repeat_interleave(32, -1)
        assert err.max() < tol, (bits, err.max())
        # a block's scale moves only its own 32 columns
        s2 = scales.clone()
        s2[:, 1] += 1
        d = kernels.call(op, codes, s2, torch.float32)
        assert torch.equal(d[:, :32], d32[:, :32]) and torch.equal(d[:, 32:], 2 * d32[:, 32:])


def test_nvfp4_both_conventions():
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    packed, s, s2 = quantize_nvfp4(w)
    mo = kernels.call("dequant_nvfp4", packed, s, s2, False, torch.float32)
    ct = kernels.call("dequant_nvfp4", packed, s, 1.0 / s2, True, torch.float32)
    assert (mo - w).norm() / w.norm() < 0.12
    assert torch.allclose(mo, ct, rtol=1e-6, atol=0)
    exact = kernels.call("dequant_nvfp4", packed, s, torch.tensor(0.25), False, torch.float32)
    codes = kq.e2m1_to_float(kq.unpack_fp4(packed))
    assert torch.equal(exact, codes * s.float().repeat_interleave(16, -1) * 0.25)


def test_fp8_rows_and_scaled_mm():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(16, 64, generator=g), torch.randn(5, 64, generator=g)
    wq, ws = kernels.call("quantize_fp8_rows", w)
    assert ws.shape == (16, 1) and torch.allclose(ws, w.abs().amax(-1, keepdim=True) / 448)
    assert (kernels.call("dequant_fp8", wq, ws, torch.float32) - w).norm() / w.norm() < 0.04
    xq, xs = kernels.call("quantize_fp8_rows", x)
    mm = kernels.call("fp8_scaled_mm", xq, xs, wq, ws, torch.float32)
    assert torch.allclose(mm, (xq.float() * xs) @ (wq.float() * ws).t(), rtol=1e-5, atol=1e-5)
    y = kernels.call("linear_fp8", x.view(1, 5, 64), wq, ws)
    assert y.shape == (1, 5, 16) and (y[0] - x @ w.t()).norm() / (x @ w.t()).norm() < 0.06
    z = torch.zeros(2, 8)
    zq, zs = kernels.call("quantize_fp8_rows", z)
    assert torch.equal(zs, torch.ones(2, 1)) and torch.equal(zq.float(), z)


def test_weight_only_gemm_references():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 16, 64, generator=g)
    x = torch.randn(7, 64, generator=g)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    codes, scales = zip(*(quantize_mx(w[e], 4) for e in range(3)))
    codes, scales = torch.stack(codes), torch.stack(scales)
    wd = kernels.call("dequant_mxfp4", codes, scales, torch.float32)
    assert torch.equal(kernels.call("linear_mxfp4", x, codes[0], scales[0]), F.linear(x, wd[0]))
    ref = torch.cat([x[:2] @ wd[0].t(), x[2:7] @ wd[2].t()])
    assert torch.allclose(kernels.call("grouped_mm_mxfp4", x, codes, scales, offs), ref, atol=1e-5)
    for op in ("dequant_mxfp8", "dequant_mxfp4", "dequant_nvfp4", "dequant_fp8"):
        assert kernels.ops()[op] == ["torch"], op
    # the CUDA variants (tests/test_kernels_quant.py), registered where Triton imports
    for op in ("linear_mxfp8", "linear_nvfp4"):
        assert kernels.ops()[op] == ["gemv", "triton", "torch"], op
    for op in ("grouped_mm_mxfp8", "grouped_mm_nvfp4", "quantize_fp8_rows"):
        assert kernels.ops()[op] == ["triton", "torch"], op
    assert kernels.ops()["linear_fp8"] == ["gemv", "scaled_mm", "torch"]        # a few tokens on the GEMV
    for op in ("fp8_scaled_mm", "linear_fp8", "grouped_mm_fp8"):
        assert kernels.ops()[op][-2:] == ["scaled_mm", "torch"], op
        assert [i.backend for i in kernels.registry.candidates(op, "cpu", torch.float32)] == ["torch"], op


# ------------------------------------------------------------------ declared formats
def test_auto_round_declared_formats_both_expert_keys():
    base = {"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "bits": 8, "group_size": 32,
            "data_type": "mx_fp", "block_name_to_quantize": "model.layers",
            "extra_config": {"model.layers.0.mlp.gate.wg": {"bits": 16, "data_type": "float"}}}
    for key in (".mlp.experts.", ".*mlp\\.experts"):       # the stock key and the card's regex fix
        qc = dict(base, extra_config={key: {"bits": 4}, **base["extra_config"]})
        s = QuantScheme.from_config({"quantization_config": qc})
        assert s.declared("model.layers.3.mlp.experts.10.down_proj") is W.MXFP4, key
        assert s.declared("model.layers.3.self_attn.qkv_proj") is W.MXFP8
        assert s.declared("model.layers.0.mlp.gate.wg") is W.BF16
        assert s.declared("time_embed.mlp.0") is W.BF16                   # outside block_name_to_quantize
    bad = QuantScheme.from_config({"quantization_config": dict(base, data_type="int", bits=4,
                                                               packing_format="auto_round:auto_gptq")})
    assert "auto_round:auto_gptq" in bad.unsupported


def test_compressed_tensors_precedence_and_modelopt():
    mx4 = {"type": "float", "num_bits": 4, "group_size": 32, "strategy": "group"}
    mx8 = {"type": "float", "num_bits": 8, "group_size": 32, "strategy": "group"}
    nv4 = {"type": "float", "num_bits": 4, "group_size": 16, "strategy": "tensor_group"}
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision",
          "config_groups": {"a": {"targets": ["Linear"], "weights": mx8},
                            "b": {"targets": ["re:.*experts\\.1\\..*"], "weights": nv4},
                            "c": {"targets": ["model.layers.0.mlp.experts.1.down_proj"], "weights": mx4}},
          "ignore": ["re:.*lm_head", "model.layers.0.self_attn.o_proj"]}
    s = QuantScheme.from_config({"quantization_config": qc})
    assert s.declared("model.layers.0.mlp.experts.1.down_proj") is W.MXFP4       # exact beats regex beats class
    assert s.declared("model.layers.0.mlp.experts.1.gate_and_up_proj") is W.NVFP4
    assert s.declared("model.layers.0.mlp.experts.2.down_proj") is W.MXFP8
    assert s.declared("model.layers.0.self_attn.o_proj") is W.BF16 and s.declared("lm_head") is W.BF16
    int4 = dict(qc, config_groups={"g": {"targets": ["Linear"], "weights": {"type": "int", "num_bits": 4,
                                                                           "strategy": "group", "group_size": 128}}},
                format="pack-quantized")
    assert "compressed-tensors int4" in QuantScheme.from_config({"quantization_config": int4}).unsupported
    mo = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": ["lm_head", "*.mlp.gate.wg"],
          "quantized_layers": {"model.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
                               "model.layers.0.self_attn.qkv_proj": {"quant_algo": "FP8"}}}
    s = QuantScheme.from_config({"quantization_config": mo})
    assert s.declared("model.layers.0.mlp.experts.3.down_proj") is W.NVFP4        # a parent entry
    assert s.declared("model.layers.0.self_attn.qkv_proj") is W.FP8_TENSOR
    assert s.declared("model.layers.0.self_attn.o_proj") is W.BF16
    assert s.declared("model.layers.1.mlp.gate.wg") is W.BF16
    w4a8 = QuantScheme.from_config({"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}})
    assert "ModelOpt W4A8_AWQ" in w4a8.unsupported


# ------------------------------------------------------------------ loading
@pytest.fixture(scope="module")
def float_blocks(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("qf") / "bf16", blocks=True)


@pytest.fixture(scope="module")
def written(tmp_path_factory, float_blocks):
    """Every format our writer knows, on the block-aligned tiny model (same seed as float_blocks)."""
    root = tmp_path_factory.mktemp("qw")
    return {f: make_tiny(root / f, blocks=True, quant=f) for f in QUANT_FORMATS}


EXPECTED = {"mxfp8": (W.MXFP8, W.MXFP8, 0.04), "mxfp8-ct": (W.MXFP8, W.MXFP8, 0.04),
            "mxfp4": (W.MXFP4, W.MXFP8, 0.13), "mxfp4-ct": (W.MXFP4, W.MXFP8, 0.13),
            "nvfp4-ct": (W.NVFP4, W.NVFP4, 0.11), "fp8-modelopt": (W.FP8_TENSOR, W.FP8_TENSOR, 0.04),
            "fp8-channel-modelopt": (W.FP8_CHANNEL, W.FP8_CHANNEL, 0.04),
            "nvfp4-modelopt": (W.NVFP4, W.FP8_TENSOR, 0.11)}


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_written_formats_load_to_their_dequantization(written, float_blocks, fmt):
    ref = load(float_blocks)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lm = load(written[fmt])
    assert not [r for r in record if issubclass(r.category, FormatMismatchWarning)]
    ck = Checkpoint(written[fmt])
    _, formats = plan_checkpoint(lm.cfg, ck)
    experts, dense_fmt, tol = EXPECTED[fmt]
    assert formats["model.layers.1.mlp.experts.2.down_proj"].format is experts
    assert formats["model.layers.0.self_attn.qkv_proj"].format is dense_fmt
    assert len(formats) == len(backbone_linears(lm.cfg))
    ck.formats = formats
    tr, tr0 = lm.model.transformer, ref.model.transformer
    qkv = dense(read_rows(ck, "model.layers.0.self_attn.qkv_proj", tr.layers[0].self_attn.qkv.shape[1], ShardLayout()),
                torch.float32)
    assert torch.equal(tr.layers[0].self_attn.qkv[0], qkv)
    for name, p in tr.named_parameters():
        p0 = dict(tr0.named_parameters())[name]
        rel = ((p - p0).norm() / p0.norm()).item()
        if name.endswith(("qkv", "o_proj", "w1", "w2", "shared_w1", "shared_w2")):
            assert 0 < rel < tol, (name, rel)
        else:
            assert rel == 0, name                       # router, norms, embeddings, head stay as stored
    for name, mod in lm.model.replicated_modules().items():
        for k, v in mod.state_dict().items():
            assert torch.equal(v, ref.model.replicated_modules()[name].state_dict()[k]), (name, k)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder, fn):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        t = load_file(str(folder / file))
        fn(t)
        save_file(t, str(folder / file))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != file} | {n: file for n in t}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _set_config(folder, fn):
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_tensors_win_over_the_config_with_a_warning(written, tmp_path):
    """auto-round 0.15.0 given the regex key as --layer_config writes MXFP8 experts (its own matcher
    escapes the key) while its config says 4 bits: the experts load as the MXFP8 they are."""
    folder = _copy(written["mxfp8"], tmp_path / "ck")
    _set_config(folder, lambda c: c["quantization_config"]["extra_config"].update({".*mlp\\.experts": {"bits": 4}}))
    with pytest.warns(FormatMismatchWarning) as record:
        lm = load(folder)
    messages = [str(r.message) for r in record]
    assert messages[0] == ("model.layers.0.mlp.experts.0.gate_and_up_proj: quantization_config says mxfp4, its "
                           "tensors are mxfp8; loading it as mxfp8")
    assert len(messages) == 9 and messages[-1].startswith("... and 8 more layers")    # 16 experts, 8 named
    ref = load(written["mxfp8"])
    assert torch.equal(lm.model.transformer.layers[0].mlp.w1, ref.model.transformer.layers[0].mlp.w1)


def test_bf16_stored_mxfp8_loads_when_lossless(written, tmp_path):
    folder = _copy(written["mxfp8"], tmp_path / "ck")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)) if name in t else None)
    assert Checkpoint(folder).info(name).dtype == "BF16"
    a, b = load(folder).model.transformer, load(written["mxfp8"]).model.transformer
    assert torch.equal(a.layers[0].self_attn.qkv, b.layers[0].self_attn.qkv)
    _rewrite(folder, lambda t: t[name].view(-1)[0].fill_(0.1234) if name in t else None)
    with pytest.raises(CheckpointError, match="not float8 E4M3"):
        load(folder)


def test_plan_that_cuts_a_block_is_refused_before_any_read(tmp_path):
    folder = make_tiny(tmp_path / "tiny_mx", quant="mxfp4")       # default dims: expert intermediate 32
    lm = load(folder)                                            # tp1: whole blocks
    assert lm.model.transformer.layers[0].mlp.w2.shape[-1] == 32
    ck = Checkpoint(folder)
    cc = CheckpointConfig.load(folder)
    with pytest.raises(CheckpointError, match=r"the attention width \(heads x head_dim\) \(128, the input dimension K "
                                              r"of model\.layers\.0\.self_attn\.o_proj\) splits into 16 columns per "
                                              r"micro shard over 8 micro shards, which cuts its MXFP8 scale blocks"):
        plan_checkpoint(cc.model, ck, ShardLayout(4, 1, 2))
    with pytest.raises(CheckpointError, match=r"layer 0's shared MLP intermediate size \(32, the input dimension K of "
                                              r"model\.layers\.0\.mlp\.shared_mlp\.down_proj\) splits into 16 columns "
                                              r"per micro shard over 2 micro shards, which cuts its MXFP8 scale blocks"):
        plan_checkpoint(cc.model, ck, ShardLayout(2, 0, 1))
    assert ck.bytes_read == 0
    with pytest.raises(CheckpointError, match="expert intermediate size|shared MLP intermediate size"):
        load(folder, layout=ShardLayout(2, 1, 1))


def test_unsupported_formats_name_themselves_and_the_first_layer(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, tmp_path / "gptq")
    layer = "model.layers.0.self_attn.qkv_proj"
    def to_gptq(t):
        if layer + ".weight" in t:
            w = t.pop(layer + ".weight")
            t |= {layer + ".qweight": torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32),
                  layer + ".qzeros": torch.zeros(1, w.shape[0] // 8, dtype=torch.int32),
                  layer + ".scales": torch.ones(1, w.shape[0], dtype=torch.float16)}
    _rewrite(folder, to_gptq)
    with pytest.raises(CheckpointError, match=f"layer {layer} holds qweight I32 .*not a weight format this engine"):
        load(folder)                                              # no config: the tensors alone are refused
    _set_config(folder, lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}))
    with pytest.raises(CheckpointError, match=f"quant_method 'gptq'.*first quantized layer: {layer}"):
        load(folder)
    _set_config(folder, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}))
    with pytest.raises(CheckpointError, match="quant_method 'awq'"):
        load(folder)
    _set_config(folder, lambda c: c.update(quantization_config={"quant_method": "bitsandbytes"}))
    with pytest.raises(CheckpointError, match="'bitsandbytes'"):
        load(folder)


def test_high_precision_layers_stored_quantized_are_refused(written, tmp_path):
    folder = _copy(written["mxfp8"], tmp_path / "ck")
    def quantize_head(t):
        if "lm_head.weight" in t:
            codes, scales = quantize_mx(t.pop("lm_head.weight").float(), 8)
            t |= {"lm_head.weight": codes, "lm_head.weight_scale": scales}
    _rewrite(folder, quantize_head)
    with pytest.raises(CheckpointError, match="lm_head is stored quantized .*keeps it in high precision"):
        load(folder)


def test_modelopt_side_config_and_make_tiny_cli(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "mo"
    p = subprocess.run([sys.executable, "-m", "tools.tiny", str(out), "--blocks", "--quant", "nvfp4-modelopt"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert hf["quantization"]["quant_algo"] == "MIXED_PRECISION"
    # a folder whose config.json lacks quantization_config: hf_quant_config.json declares the formats
    _set_config(out, lambda c: c.pop("quantization_config"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FormatMismatchWarning)
        lm = load(out)
    assert lm.model.transformer.layers[0].mlp.w1.dtype == torch.float32
    p = subprocess.run([sys.executable, "-m", "tools.tiny", str(tmp_path / "x"), "--quant", "int3"],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "unknown --quant 'int3'" in p.stderr
