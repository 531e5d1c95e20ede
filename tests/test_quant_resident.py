"""Quantized weights kept resident (the CUDA layout, exercised here on the CPU through the reference
ops): the packs hold codes and scales in the engine's packing (gate/up micro-major, down cols-packed), every micro view of every plan's
shard dequantizes to the dense shard's view, a whole request gives the dense load's text and image, and
`--quantize fp8` (online FP8 from a high-precision checkpoint) in both residencies."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

import hunyuan_kernels as kernels
from engine.model.loader import keeps_quantized, load
from engine.model.packed import QuantPack, linear, micro_cols, micro_rows
from engine.model.transformer import Transformer
from engine.model.weights import SKIPPED_PREFIXES, plan_checkpoint, resident_packs
from engine.checkpoint.shapes import backbone_linears
from engine.parallel.layout import PhaseView, ShardLayout
from engine.runtime.events import Error, Image, Text
from engine.runtime.request import Request
from engine.checkpoint import names
from engine.checkpoint.shards import Checkpoint, CheckpointError
from engine.checkpoint.config import CheckpointConfig
from tools.tiny import make_tiny
from tools.tiny_quant import QUANT_FORMATS
from engine_drive import make_engine

PACKS = ("self_attn.qkv", "self_attn.o_proj", "mlp.w1", "mlp.w2", "mlp.shared_w1", "mlp.shared_w2")
# the kernel format of the experts and of the dense linears each writer format leaves
KERNEL_FMT = {"mxfp8": ("mxfp8", "mxfp8"), "mxfp8-ct": ("mxfp8", "mxfp8"), "mxfp4": ("mxfp4", "mxfp8"),
              "mxfp4-ct": ("mxfp4", "mxfp8"), "nvfp4-ct": ("nvfp4", "nvfp4"), "fp8-modelopt": ("fp8", "fp8"),
              "fp8-channel-modelopt": ("fp8", "fp8"), "nvfp4-modelopt": ("nvfp4", "fp8")}
W8A8 = {"fp8-modelopt", "fp8-channel-modelopt", "nvfp4-modelopt"}     # activations quantized per token too
REQ = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=3, greedy=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("resident")
    out = {f: make_tiny(root / f, blocks=True, quant=f) for f in QUANT_FORMATS}
    out["bf16"] = make_tiny(root / "bf16", blocks=True)
    return out


def _outcome(lm, text_only=False):
    events = list(make_engine(lm, preview_every=0).run(Request(**REQ, text_only=text_only)))
    assert not [e for e in events if isinstance(e, Error)], [e for e in events if isinstance(e, Error)]
    text = "".join(e.delta for e in events if isinstance(e, Text))
    if text_only:
        return text, None
    img = next(e for e in events if isinstance(e, Image))
    return text, np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64)


def _param(module, name):
    for part in name.split("."):
        module = getattr(module, part)
    return module


def test_residency_choice():
    assert keeps_quantized("cuda", torch.bfloat16) and not keeps_quantized("cuda", torch.float32)
    assert not keeps_quantized("cpu", torch.float32) and keeps_quantized("cpu", torch.float32, "quantized")
    assert not keeps_quantized("cuda", torch.bfloat16, "dense")
    with pytest.raises(ValueError, match="unknown resident"):
        keeps_quantized("cpu", torch.float32, "int4")


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_resident_packs_run_a_request_as_the_dense_load(folders, fmt):
    dense, quant = load(folders[fmt]), load(folders[fmt], resident="quantized")
    experts, dense_fmt = KERNEL_FMT[fmt]
    for i, (lq, ld) in enumerate(zip(quant.model.transformer.layers, dense.model.transformer.layers)):
        for name in PACKS:
            p, p0 = _param(lq, name), _param(ld, name)
            assert isinstance(p, QuantPack), (i, name)
            assert p.format.fmt == (experts if name in ("mlp.w1", "mlp.w2") else dense_fmt), (i, name)
            assert p.shape == tuple(p0.shape)
            assert torch.equal(p.value().dequantize(torch.float32), p0), (i, name)    # same weights, kept compact
    q_bytes = sum(t.numel() * t.element_size() for t in quant.model.transformer.parameters())
    d_bytes = sum(t.numel() * t.element_size() for t in dense.model.transformer.parameters())
    assert q_bytes < 0.6 * d_bytes
    if fmt in W8A8:       # the FP8 layers also quantize their activations (per layer: the view test below),
        text, _ = _outcome(quant, text_only=True)     # and the untrained tiny model's sampling then drifts
        assert len(text) > 0
    elif fmt != "mxfp8-ct":   # weight-only: the reference ops compute exactly the dense load's numbers
        (text0, img0), (text1, img1) = _outcome(dense), _outcome(quant)      # (mxfp8-ct: mxfp8's tensors)
        assert text1 == text0 and np.array_equal(img0, img1)


def _transformers(folder, layout, quantize=None):
    cc, ck = CheckpointConfig.load(folder), Checkpoint(folder)
    out = []
    for keep in (True, False):
        expected, formats = plan_checkpoint(cc.model, ck, layout, quantize=quantize)
        ck.validate(expected, skipped=[n for n in ck.tensors if n.startswith(SKIPPED_PREFIXES)])
        ck.formats = formats
        ck.online = frozenset(backbone_linears(cc.model)) if quantize else frozenset()
        tr = Transformer(cc.model, layout, resident=resident_packs(cc.model, formats, quantize) if keep else None)
        with torch.no_grad():
            for i, layer in enumerate(tr.layers):
                layer.load(ck, names.layer(i), layout)
        out.append(tr)
    return out


LAYOUTS = [ShardLayout(2, 1, 2), ShardLayout(2, 0, 4), ShardLayout(8, 5, 1)]     # tp1: the request test


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4-modelopt"])     # MX; NVFP4 experts with FP8 per-tensor dense
def test_every_micro_view_of_every_shard_is_the_dense_view(folders, fmt):
    """Each rank's packs, viewed per AR micro and for the whole storage shard (denoise), dequantize to the
    dense parameters' views; the quantized MoE of each view is the dense MoE's, bit for bit (weight-only
    formats, fp32 on the CPU)."""
    g = torch.Generator().manual_seed(0)
    for layout in LAYOUTS:
        tq, td = _transformers(folders[fmt], layout)
        views = [PhaseView(m, 1) for m in range(layout.micros)] + [PhaseView(0, layout.micros)]
        for lq, ld in zip(tq.layers, td.layers):
            aq, ad = lq.self_attn, ld.self_attn
            mq, md = lq.mlp, ld.mlp
            for view in views:
                # the cols-packed expert down pack: a view's micros are one column block of codes and scales
                c0, c1 = view.micro_start * md.inter_micro, (view.micro_start + view.micro_count) * md.inter_micro
                assert torch.equal(mq.w2.value().cols(c0, c1).dequantize(torch.float32), md.w2[:, :, c0:c1])
                wq, wd = micro_rows(aq.qkv, view), micro_rows(ad.qkv, view)
                assert torch.equal(wq.dequantize(torch.float32), wd), (layout, view)
                oq, od = micro_cols(aq.o_proj, view, aq.micros), micro_cols(ad.o_proj, view, ad.micros)
                assert torch.equal(oq.dequantize(torch.float32), od), (layout, view)
                x = torch.randn(5, wd.shape[1], generator=g)
                y = torch.randn(5, od.shape[1], generator=g)
                if fmt in W8A8:          # W8A8: the activations' rounding on top
                    assert ((linear(x, wq) - x @ wd.T).norm() / (x @ wd.T).norm()).item() < 0.06
                else:
                    assert torch.equal(linear(x, wq), linear(x, wd)) and torch.equal(linear(y, oq), linear(y, od))
                h = torch.randn(7, wd.shape[1], generator=g)
                got, want = lq.mlp(h, view), ld.mlp(h, view)
                if fmt in W8A8:
                    assert ((got - want).norm() / want.norm()).item() < 0.1
                else:
                    assert torch.equal(got, want), (layout, view)


def test_expert_down_pack_is_the_checkpoints_columns_as_stored(folders):
    """w2 [E, H, micros * I_micro]: expert e's row block is the official down_proj [H, I] restricted to
    the storage shard's input columns, in checkpoint order (micro m = columns [m*I_micro, (m+1)*I_micro))."""
    ck = Checkpoint(folders["bf16"])
    for layout in LAYOUTS:
        _, td = _transformers(folders["bf16"], layout)
        for i, layer in enumerate(td.layers):
            m = layer.mlp
            width = m.micros * m.inter_micro
            assert m.w2.shape == (m.experts, m.gate.shape[1], width)
            for e in range(m.experts):
                full = ck.read(f"model.layers.{i}.mlp.experts.{e}.down_proj.weight")
                cols = full[:, layout.storage_rank * width:(layout.storage_rank + 1) * width]
                assert torch.equal(m.w2[e], cols.to(m.w2.dtype)), (layout, i, e)


def test_online_fp8_dense_and_resident(folders):
    ref = load(folders["bf16"])
    fp8 = load(folders["bf16"], quantize="fp8")
    resident = load(folders["bf16"], quantize="fp8", resident="quantized")
    tr0, tr1, tr2 = (m.model.transformer for m in (ref, fp8, resident))
    for (name, p0), (_, p1) in zip(tr0.named_parameters(), tr1.named_parameters()):
        rel = ((p1 - p0).norm() / p0.norm()).item()
        if name.endswith(("qkv", "o_proj", "w1", "w2", "shared_w1", "shared_w2")):
            assert 0 < rel < 0.04, (name, rel)             # fp8-rounded, one scale per output row
        else:
            assert rel == 0, name                           # router, norms, embeddings, LM head untouched
    for i, (l1, l2) in enumerate(zip(tr1.layers, tr2.layers)):
        for name in PACKS:
            p = _param(l2, name)
            assert isinstance(p, QuantPack) and p.format.fmt == "fp8" and p.codes.dtype == torch.float8_e4m3fn
            assert torch.equal(p.value().dequantize(torch.float32), _param(l1, name)), (i, name)
    w = ref.model.transformer.layers[0].self_attn.qkv[0]
    codes, scale = kernels.call("quantize_fp8_rows", w)
    assert torch.equal(tr2.layers[0].self_attn.qkv.codes[0].float(), codes.float())
    assert torch.equal(tr2.layers[0].self_attn.qkv.scales[0], scale)
    for name, mod in resident.model.replicated_modules().items():       # ViT, VAE, embedders untouched
        for k, v in mod.state_dict().items():
            assert torch.equal(v, ref.model.replicated_modules()[name].state_dict()[k]), (name, k)
    text, img = _outcome(resident)            # plus per-token FP8 activations: runs end to end
    assert len(text) > 0 and img.size > 0
    tq, td = _transformers(folders["bf16"], ShardLayout(2, 1, 2), quantize="fp8")
    g = torch.Generator().manual_seed(1)
    for view in (PhaseView(1, 1), PhaseView(0, 2)):             # W8A8 against W8A16 on the same FP8 weights
        for lq, ld in zip(tq.layers, td.layers):
            w = micro_rows(lq.self_attn.qkv, view)
            x = torch.randn(6, w.shape[1], generator=g)
            want = linear(x, micro_rows(ld.self_attn.qkv, view))
            assert 0 < ((linear(x, w) - want).norm() / want.norm()).item() < 0.06
            h = torch.randn(6, w.shape[1], generator=g)
            want = ld.mlp(h, view)
            assert 0 < ((lq.mlp(h, view) - want).norm() / want.norm()).item() < 0.1


def test_online_fp8_refuses_a_quantized_checkpoint_and_unknown_formats(folders):
    with pytest.raises(CheckpointError, match=r"--quantize fp8 quantizes a high-precision checkpoint .* already "
                                              r"quantized \(model\.layers\.0\.self_attn\.qkv_proj is stored as mxfp8\)"):
        load(folders["mxfp4"], quantize="fp8")
    with pytest.raises(ValueError, match="unknown quantize 'int4'"):
        load(folders["bf16"], quantize="int4")


def test_quantize_flag_reaches_the_load(folders):
    """`--quantize fp8` from the command line, app.py and EngineServer down to every rank's load."""
    import subprocess
    import sys
    from pathlib import Path

    import app
    from engine.serve.engine_config import EngineConfig
    from engine.serve.server import EngineServer
    root = Path(__file__).resolve().parents[1]
    assert app.parse_args(["--quantize", "fp8"]).engine.quantize == "fp8" and app.parse_args([]).engine.quantize is None
    p = subprocess.run([sys.executable, "-m", "engine", "text", "--model", str(folders["bf16"]), "--prompt", "a red circle",
                        "--max-new-tokens", "4", "--seed", "1", "--quantize", "fp8"], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "[think]" in p.stdout, p.stderr[-2000:]
    with pytest.raises(ValueError, match="unknown quantize 'int8'"):
        EngineServer(EngineConfig(folders["bf16"], quantize="int8"))
    with EngineServer(EngineConfig(folders["mxfp4"], plan="tp2", quantize="fp8", preview_every=0)) as server:   # two gloo ranks
        assert not server.wait_ready(120)
        assert "already quantized" in server.health()["last_error"]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4-folded", "nvfp4-ct", "nvfp4-modelopt", "fp8-channel-modelopt",
                                 "online-fp8"])
def test_gpu_resident_quantized_model_runs_on_the_fast_ops(folders, fmt):
    """On CUDA bf16 the packs stay quantized by default and the layers run the Triton / scaled-mm ops
    (each layer within its format's tolerance of the dequantized load); a whole request runs, with
    the AR decode as a CUDA graph over the quantized decode kernels. mxfp4-folded: the mixed build with its
    MXFP8 linears folded into FP8 (`--mxfp8-kernels fp8`: W8A8 beside the MXFP4 experts)."""
    online, folded = fmt == "online-fp8", fmt == "mxfp4-folded"
    folder, quantize = (folders["bf16"], "fp8") if online else (folders["mxfp4" if folded else fmt], None)
    lm = load(folder, "cuda", torch.bfloat16, quantize=quantize)
    if folded:
        from engine.model.kernel_layouts import fold_mxfp8_weights
        assert fold_mxfp8_weights(lm.model, "fp8") == "fp8"
        assert lm.model.transformer.layers[0].self_attn.qkv.format.fmt == "fp8"
    dense = load(folder, "cuda", torch.bfloat16, quantize=quantize, resident="dense")
    from hunyuan_kernels.quant import humming
    moe = ["decode", "batched", "grouped"] + (["humming"] if humming.available() else [])   # the `humming` extra
    for op, names in (("moe_quant", moe), ("linear_mxfp8", ["gemv", "triton"]),
                      ("linear_nvfp4", ["gemv", "triton"]), ("linear_fp8", ["gemv", "scaled_mm"])):
        assert [i.backend for i in kernels.registry.candidates(op, "cuda", torch.bfloat16)] == names + ["torch"], op
    g = torch.Generator(device="cuda").manual_seed(0)
    tol = 5e-2 if fmt in W8A8 or online or folded else 2e-2
    for lq, ld in zip(lm.model.transformer.layers, dense.model.transformer.layers):
        for name in PACKS:
            assert isinstance(_param(lq, name), QuantPack), name
        for n in (1, 6, 300):                 # decode and grouped paths
            h = torch.randn(n, 64, generator=g, device="cuda").to(torch.bfloat16)
            want = ld.mlp(h, PhaseView())
            got = lm_out = lq.mlp(h, PhaseView())
            assert not lm_out.isnan().any()
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol, (fmt, n)
            w = micro_rows(lq.self_attn.qkv, PhaseView())
            want = linear(h, micro_rows(ld.self_attn.qkv, PhaseView()))
            assert ((linear(h, w).float() - want.float()).norm() / want.float().norm()).item() < tol
    q_bytes = sum(t.numel() * t.element_size() for t in lm.model.transformer.parameters())
    d_bytes = sum(t.numel() * t.element_size() for t in dense.model.transformer.parameters())
    assert q_bytes < 0.8 * d_bytes
    text, img = _outcome(lm)
    assert len(text) > 0 and img.size > 0
